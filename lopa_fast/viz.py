"""Pictures of a decode: the fill order from `generate(..., return_trace=True)`.

    out = lopa_fast.generate(model, ids, "lopa", return_trace=True, ...)
    lopa_fast.viz.fill_order_png(out.trace, "fill.png", tokens=tok.convert_ids_to_tokens(out.generated_ids))
    print(lopa_fast.viz.fill_order_text(out.trace, tokens))

`fill_rounds` reads the trace: the round (1-based, the trace's `round`) in which each generated position was
filled, and the positions a winning LoPA lookahead branch filled (the winner's `lookahead` position). Positions
are relative to the prompt end, as in the trace. The PNG is a matplotlib heatmap (Agg backend, no display
needed): one cell per position, coloured by round, lookahead wins marked with a star.
"""
from __future__ import annotations

from pathlib import Path


def fill_rounds(trace: list[dict], n: int | None = None) -> tuple[list[int], set[int]]:
    """(round per position, lookahead-win positions). Unfilled positions (or ones the trace does not cover)
    get 0; `n` defaults to one past the last accepted position."""
    if not trace:
        raise ValueError("fill_rounds: empty trace; pass return_trace=True to lopa_fast.generate")
    first: dict[int, int] = {}
    look: set[int] = set()
    for r in trace:
        for pos, _tok in r.get("accepted", ()):
            first.setdefault(int(pos), int(r["round"]))
        branches, winner = r.get("branches"), r.get("winner")
        if branches and winner is not None:
            w = branches[winner].get("lookahead")
            if w is not None:
                look.add(int(w))
    if n is None:
        n = max(first, default=-1) + 1
    return [first.get(i, 0) for i in range(n)], {p for p in look if p < n}


def fill_order_text(trace: list[dict], tokens: list[str] | None = None, n: int | None = None,
                    width: int | None = None) -> str:
    """The terminal view: two aligned lines, the tokens (or position numbers) and the round that filled each
    (`*` marks a token taken from a winning lookahead branch; `?` a position the trace never filled). width: at
    most this many characters a line, the aligned pair continued on further pairs of lines (None: one pair)."""
    if tokens is not None and n is None:
        n = len(tokens)
    rounds, look = fill_rounds(trace, n)
    top_cells = list(tokens) if tokens is not None else [str(i) for i in range(len(rounds))]
    bot_cells = [f"{r if r else '?'}{'*' if i in look else ''}" for i, r in enumerate(rounds)]
    w = [max(len(a), len(b)) for a, b in zip(top_cells, bot_cells)]
    room = None if width is None else max(1, width - len("tokens: "))
    chunks, start, used = [], 0, 0  # cells [start, i) fit in `room` characters
    for i, k in enumerate(w):
        if room is not None and i > start and used + 1 + k > room:
            chunks.append((start, i))
            start, used = i, 0
        used += k + (1 if i > start else 0)
    chunks.append((start, len(w)))
    pairs = []
    for a, b in chunks:
        top = " ".join(c.rjust(k) for c, k in zip(top_cells[a:b], w[a:b]))
        bot = " ".join(c.rjust(k) for c, k in zip(bot_cells[a:b], w[a:b]))
        pairs.append(f"tokens: {top}\nround:  {bot}")
    return "\n".join(pairs)


def fill_order_png(trace: list[dict], path, *, tokens: list[str] | None = None, n: int | None = None,
                   title: str | None = None, width: int = 800, height: int = 220, dpi: int = 100) -> Path:
    """Write the fill order as a `width` x `height` PNG heatmap (matplotlib, Agg); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if tokens is not None and n is None:
        n = len(tokens)
    rounds, look = fill_rounds(trace, n)
    n = len(rounds)
    path = Path(path)
    fig, ax = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        top = max(rounds) if rounds else 1
        im = ax.imshow([rounds], aspect="auto", cmap="viridis", vmin=0, vmax=max(1, top), interpolation="nearest")
        for i, r in enumerate(rounds):
            if n <= 64:
                ax.text(i, 0, str(r) if r else "?", ha="center", va="center", fontsize=7,
                        color="white" if r < 0.6 * top else "black")
        if look:
            xs = sorted(look)
            ax.scatter(xs, [-0.35] * len(xs), marker="*", s=60, color="red", label="lookahead win", zorder=3)
            ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
        ax.set_yticks([])
        if tokens is not None and n <= 64:
            ax.set_xticks(range(n), list(tokens)[:n], rotation=90, fontsize=6)
        else:
            ax.set_xlabel("generated position")
        ax.set_title(title or f"fill order: {n} positions, {max(rounds, default=0)} rounds", fontsize=9)
        fig.colorbar(im, ax=ax, label="round", fraction=0.03, pad=0.01)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


__all__ = ["fill_order_png", "fill_order_text", "fill_rounds"]


class StepView:
    """The live denoising view, as a progress hook `view(prefix, info)` (generate's / stream's `on_round=`): the
    decoded positions, each shown as its token's text and every mask as `_`, after every round.

    On a terminal (`tty`, default: out.isatty()) the view is redrawn in place (ANSI: cursor up over the lines
    the last view took, clear to the end of the screen); otherwise one plain line per round
    ("round R (F/N filled): ..."), which logs and tests read.
    token_text: ids -> list[str], one text per position (default str of the id).
    """

    MASK = "_"

    def __init__(self, token_text=None, out=None, tty: bool | None = None, width: int | None = None):
        import shutil
        import sys

        self.out = out if out is not None else sys.stdout
        self.tty = bool(tty if tty is not None else getattr(self.out, "isatty", lambda: False)())
        self.width = width or shutil.get_terminal_size((100, 24)).columns
        self.token_text = token_text or (lambda ids: [str(t) for t in ids])
        self._lines = 0

    def line(self, info: dict) -> str:
        """One round's view: 'round R (F/N filled): tok tok _ _ ...'."""
        canvas, mask = info["canvas"], info["mask_token_id"]
        known = [t for t in canvas if t != mask]
        texts = iter(self.token_text(known))
        cells = [self.MASK if t == mask else (next(texts).strip() or "·") for t in canvas]
        return f"round {info['round']} ({len(known)}/{len(canvas)} filled): " + " ".join(cells)

    def __call__(self, prefix, info) -> None:
        text = self.line(info)
        if self.tty:
            if self._lines:
                self.out.write(f"\x1b[{self._lines}F\x1b[J")  # up to the start of the last view, clear below
            self._lines = max(1, -(-len(text) // max(1, self.width)))
        self.out.write(text + "\n")
        self.out.flush()
