"""`rl dashboard` and `rl report`: views of run folders, read from the files the trainer writes.

Layers: `runfolder` (incremental reading of the files) -> `model` (one run's data) -> `charts`
(the library-neutral vocabulary) -> `domains` (runs of many domains: families, best and worst,
one domain) -> `panels` (what each chart and table shows) -> `plotly_render` / `report` (drawn
with plotly in the browser, with matplotlib to PNG) -> `server` (the live page). Nothing here is
imported by the trainer.
"""
