"""Domain families: one environment class declares many domains (`Environment.domains`), reached as
`FAMILY:member` where FAMILY is the name the class is registered under (`math:add-9x2`,
`shell:fix_test-scale`, `qa:capitals` for a dataset's subset). A run config names them one by one or
by pattern (`math:*`, `lookup:keys-*`, `*:*`), with a weight per domain or one per pattern that its
domains share. The family of a domain is the part of its name before the ':' (a plain environment is
a family of its own)."""
from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Any, Sequence

from envs.registry import SEP, EnvRegistryError, env_names, family_domains


GLOB_CHARS = frozenset("*?[")


def family_of(domain: str) -> str:
    return domain.split(SEP, 1)[0]


def is_pattern(name: str) -> bool:
    return any(c in GLOB_CHARS for c in name)


def families() -> list[str]:
    """Registered names that declare domains with no kwargs (a dataset family needs its files first)."""
    out = []
    for name in env_names():
        try:
            if family_domains(name):
                out.append(name)
        except EnvRegistryError:  # a registration that does not load: not listed as a family
            pass
    return out


def match(pattern: str, kwargs: dict[str, Any] | None = None) -> list[str]:
    """The domains `pattern` names, sorted: fnmatch over `FAMILY:member`, the family part a pattern too.
    kwargs are the config entry's (a dataset family lists the subsets of the files they name).
    Raises EnvRegistryError (one line) when it names none."""
    fam_pattern, sep, member_pattern = pattern.partition(SEP)
    if not sep:
        raise EnvRegistryError(f"{pattern!r} is a pattern without a family: write FAMILY:MEMBER "
                               f"(e.g. 'math:*'); families: {', '.join(families()) or 'none'}")
    names = [n for n in env_names() if fnmatch.fnmatchcase(n, fam_pattern)]
    if not names:
        close = difflib.get_close_matches(fam_pattern, env_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise EnvRegistryError(f"no family matches {fam_pattern!r} in {pattern!r}{hint} families: "
                               f"{', '.join(families()) or 'none'}")
    found = [f"{name}{SEP}{member}" for name in names for member in family_domains(name, kwargs)
             if fnmatch.fnmatchcase(member, member_pattern)]
    if not found:
        members = sorted(m for name in names for m in family_domains(name, kwargs))
        sample = ", ".join(members[:6]) + (", ..." if len(members) > 6 else "")
        raise EnvRegistryError(f"no domain matches {pattern!r}" + (f"; {fam_pattern!r} has {len(members)}: {sample}"
                                                                   if members else f"; {fam_pattern!r} declares no "
                                                                   f"domains with these kwargs"))
    return sorted(found)


class PatternError(EnvRegistryError):
    """A config entry's pattern that names nothing, or a domain two entries name; `index` is the entry's."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class Weighted:
    """One config entry as the expansion sees it: a name or pattern, and its weight per domain (weight)
    or for all its domains together (share)."""

    name: str
    weight: float
    share: float | None = None
    kwargs: dict[str, Any] | None = None


def expand(entries: Sequence[Weighted]) -> list[tuple[int, str, float]]:
    """(entry index, domain, weight) for every domain the entries name, in entry order. A domain named
    exactly is taken out of the patterns that also match it; two patterns matching one domain, or a name
    listed twice, is an error naming both entries. A share is split evenly over what its pattern keeps."""
    exact = {e.name: i for i, e in enumerate(entries) if not is_pattern(e.name)}
    owner: dict[str, int] = {}
    matched: dict[int, list[str]] = {}
    for i, entry in enumerate(entries):
        if not is_pattern(entry.name):
            continue
        try:
            domains = match(entry.name, entry.kwargs)
        except EnvRegistryError as exc:
            raise PatternError(i, str(exc)) from None
        kept = []
        for domain in domains:
            if domain in exact:
                continue
            if domain in owner:
                raise PatternError(i, f"domain {domain!r} is matched by envs.{owner[domain]} "
                                      f"({entries[owner[domain]].name!r}) too; narrow one pattern or name the "
                                      f"domain on its own")
            owner[domain] = i
            kept.append(domain)
        matched[i] = kept
    out = []
    for i, entry in enumerate(entries):
        if i not in matched:
            out.append((i, entry.name, entry.weight))
            continue
        domains = matched[i]
        each = entry.weight if entry.share is None else entry.share / max(len(domains), 1)
        out += [(i, domain, each) for domain in domains]
    return out

