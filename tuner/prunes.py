"""How a study's or a bucket's pruned configs are told: their commonest reasons, counted, and
the note of one whose every config was pruned (the sweep's summary, its log and the export)."""
from __future__ import annotations

import re
from collections import Counter

from .space import CONSTRAINT_PREFIX


def _shape(reason: str) -> str:
    """A reason with its numbers (sizes in either unit) blanked out."""
    return re.sub(r"\d+(?:\.\d+)?(?: MiB| bytes)?", "#", reason)


def pruned_summary(reasons, top: int = 2) -> str:
    """The commonest of the prune reasons `reasons`, each with how many configs it pruned;
    reasons that differ only in their numbers (a workspace size) count as one, shown by the
    first. A space constraint's reasons count only when there is no other: they are proposals
    outside the feasible space, and say nothing about why the feasible configs were pruned."""
    reasons = [r for r in reasons if isinstance(r, str) and r]   # the table reads a missing one as NaN
    own = [r for r in reasons if not r.startswith(CONSTRAINT_PREFIX)] or reasons
    groups = Counter(_shape(r) for r in own)
    first = {}
    for r in own:
        first.setdefault(_shape(r), r)
    parts = [f"{first[k]} ({n} config{'s' if n > 1 else ''})" for k, n in groups.most_common(top)]
    if len(groups) > top:
        parts.append(f"{len(groups) - top} other reason(s)")
    if len(own) < len(reasons):
        parts.append(f"{len(reasons) - len(own)} more broke a search-space constraint")
    return "; ".join(parts) or "no reason recorded"


def all_pruned_note(outcomes: dict) -> str | None:
    """`outcomes` ({outcome: its prune reasons, or any list}): the note of a study or bucket
    whose every config was pruned, or None when something was measured (or nothing tried)."""
    if not outcomes.get("pruned") or any(v for o, v in outcomes.items() if o != "pruned"):
        return None
    return f"every config was pruned: {pruned_summary(outcomes['pruned'])}"


def outcomes(trials) -> dict:
    """{outcome: the reasons of the counted `trials` with it}."""
    out: dict = {}
    for t in trials:
        out.setdefault(t.user_attrs.get("outcome"), []).append(t.user_attrs.get("reason"))
    return out
