"""A sweep's progress: trials done out of the planned total, and each study's best so far.

On a terminal a tqdm bar (redrawn in place); on a log file or a pipe, where a bar's redraws
would make one huge line, one line per study: `[done/total trials] <study>: best ...`,
written when the next study reports (or at the end). The single-process sweep reports each
trial as it finishes; the parent of `--workers` reports what it reads from the shared storage.
"""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, file=None):
        self.file = file or sys.stderr
        self.total, self.n = total, 0
        self.last = None           # (study, text) of the line not written yet (line display)
        self.bar = None
        if self.file.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="trial", dynamic_ncols=True, file=self.file)

    def update(self, k: int = 1) -> None:
        """`k` more trials done."""
        self.n += k
        if self.bar is not None:
            self.bar.update(k)

    def expect(self, k: int) -> None:
        """`k` more trials than planned (a study that sweeps a grid larger than the budget)."""
        self.total += k
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def best(self, study: str, us: float, pct_floor: float | None) -> None:
        """The best latency `study` has measured so far (its share of the roofline floor)."""
        pf = f"{pct_floor:.1f}%" if pct_floor is not None else "?"
        text = f"{study}: best {us:.1f} us ({pf} of floor)"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            return
        if self.last is not None and self.last[0] != study:
            self._line()
        self.last = (study, text, self.n)

    def _line(self) -> None:
        _, text, n = self.last
        print(f"[{n}/{self.total} trials] {text}", file=self.file, flush=True)
        self.last = None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.last is not None:
            self._line()
