"""Built-in domains: math, code (incl. HumanEval), agentic shell, tool use (lookup)."""
