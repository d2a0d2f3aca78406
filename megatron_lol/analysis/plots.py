"""PNG figures of the routing analyses (matplotlib, Agg backend, imported lazily).

Every axis names its quantity and unit; ``docs/analysis.md`` has a caption for each
figure. Each function writes ``path`` (PNG, 120 dpi), or with ``path=None`` returns
the open figure instead (tests and notebooks inspect it; the caller closes it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def _plt():
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        from megatron_lol.errors import CliError

        raise CliError("the analyses draw PNGs with matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, path: Optional[str]):
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def utilisation_heatmap(counts: torch.Tensor, path: Optional[str], title: str = ""):
    """Routed depth x block heatmap, each cell the percentage of that depth's windows that
    the block ran (paper Fig. 4). Depths are numbered from 1 (the first routed depth),
    blocks from 0, as in ``utilisation.json``."""
    plt = _plt()
    share = counts.double() / counts.sum(1, keepdim=True).clamp(min=1)
    D, L = share.shape
    fig, ax = plt.subplots(figsize=(1.6 + 0.6 * L, 1.2 + 0.45 * D))
    im = ax.imshow(100 * share.numpy(), cmap="viridis", vmin=0, vmax=100, aspect="auto")
    for d in range(D):
        for m in range(L):
            v = 100 * share[d, m].item()
            ax.text(m, d, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.set_xticks(range(L), [str(m) for m in range(L)])
    ax.set_yticks(range(D), [str(d + 1) for d in range(D)])
    ax.set_xlabel("block")
    ax.set_ylabel("routed depth")
    ax.set_title(title or "block utilisation (% of windows per depth)", fontsize=9)
    fig.colorbar(im, ax=ax, label="% of the depth's windows")
    return _finish(plt, fig, path)


def overlap_groups(coords: torch.Tensor, labels: Sequence, decimals: int = 6) -> dict:
    """``{(x, y): {label: examples}}``: examples whose PCA coordinates coincide (identical
    routing paths project to the same point) grouped per label."""
    groups: dict = {}
    for (x, y), lab in zip(coords[:, :2].tolist(), labels):
        key = (round(x, decimals), round(y, decimals))
        groups.setdefault(key, {})
        groups[key][lab] = groups[key].get(lab, 0) + 1
    return groups


def pca_scatter(
    coords: torch.Tensor,
    labels: Optional[Sequence],
    path: Optional[str],
    ratio: Optional[torch.Tensor] = None,
    title: str = "",
) -> None:
    """PCA of the path vectors. Identical paths share a point, so each (point, label) is one
    marker whose area grows with its examples, numbered when there are several; labels that
    share a point sit on a small circle around it instead of hiding each other."""
    import math

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    labels = list(labels) if labels is not None else ["all"] * coords.shape[0]
    names = sorted(set(labels), key=str)
    groups = overlap_groups(coords, labels)
    xs = [k[0] for k in groups] or [0.0]
    ys = [k[1] for k in groups] or [0.0]
    radius = 0.02 * max(max(xs) - min(xs), max(ys) - min(ys), 1e-6)
    for name in names:
        px, py, size, numbers = [], [], [], []
        for (x, y), per_label in groups.items():
            if name not in per_label:
                continue
            here = sorted(per_label, key=str)
            if len(here) > 1:  # several labels at one point: spread them around it
                angle = 2 * math.pi * here.index(name) / len(here)
                x, y = x + radius * math.cos(angle), y + radius * math.sin(angle)
            n = per_label[name]
            px.append(x)
            py.append(y)
            size.append(14 * n)
            numbers.append((x, y, n))
        ax.scatter(px, py, s=size, alpha=0.55, label=str(name), edgecolors="black", linewidths=0.3)
        for x, y, n in numbers:
            if n > 1:
                ax.annotate(str(n), (x, y), fontsize=6, ha="center", va="center")
    if len(names) > 1:
        legend = ax.legend(fontsize=7, loc="best", title="label", title_fontsize=7)
        for handle in getattr(legend, "legend_handles", getattr(legend, "legendHandles", [])):
            handle.set_sizes([24])
    pc = ["PC1", "PC2"]
    if ratio is not None:
        pc = [f"PC{i + 1} ({100 * float(r):.0f}% of variance)" for i, r in enumerate(ratio[:2])]
    ax.set_xlabel(f"{pc[0]}, path-vector units")
    ax.set_ylabel(f"{pc[1]}, path-vector units")
    ax.set_title(title or "routing paths (one-hot per depth x window), PCA", fontsize=9)
    ax.text(
        0.01,
        0.01,
        f"{len(labels)} examples at {len(groups)} distinct points; marker area and number: examples with that path",
        transform=ax.transAxes,
        fontsize=6,
        color="0.3",
    )
    return _finish(plt, fig, path)


def distinct_histogram(hist: dict, expected: float, mean: float, path: Optional[str], title: str = ""):
    plt = _plt()
    ks = sorted(int(k) for k in hist)
    total = max(1, sum(hist.values()))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(ks, [100 * hist[str(k)] / total for k in ks], color="tab:blue", alpha=0.8, label="token paths")
    ax.axvline(expected, color="tab:red", ls="--", label=f"E[U] uniform = {expected:.2f}")
    ax.axvline(mean, color="black", ls=":", label=f"mean = {mean:.2f}")
    ax.set_xlabel("distinct blocks on a token path (count)")
    ax.set_ylabel("% of token paths")
    ax.set_xticks(ks)
    ax.legend(fontsize=7)
    ax.set_title(title or "distinct blocks per routing path", fontsize=9)
    return _finish(plt, fig, path)


def per_pass_metrics(by_pass: Sequence[dict], path: Optional[str], title: str = ""):
    """B2 and MMR per loop pass (in the style of Figure 5 of the Foil paper)."""
    plt = _plt()
    passes = [p["pass"] + 1 for p in by_pass]
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3))
    a.plot(passes, [p["b2"] for p in by_pass], "o-", color="tab:blue")
    a.set_xlabel("loop pass")
    a.set_ylabel("load balance B2 (1 = uniform, 1/E = one expert)")
    b.plot(passes, [p["mmr"] for p in by_pass], "o-", color="tab:red")
    b.set_xlabel("loop pass")
    b.set_ylabel("median margin ratio MMR (>= 1)")
    for ax in (a, b):
        ax.set_xticks(passes)
    fig.suptitle(title or "routing per pass", fontsize=9)
    return _finish(plt, fig, path)


def loss_by_budget(losses: dict, path: Optional[str], title: str = ""):
    """Validation loss against Accordion's budget k (24 + k layer executions)."""
    plt = _plt()
    ks = sorted(int(k) for k in losses)
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot(ks, [losses[str(k)] for k in ks], "o-", color="tab:green")
    ax.set_xticks(ks)
    ax.set_xlabel("budget k (extra layer executions)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "loss per budget", fontsize=9)
    return _finish(plt, fig, path)
