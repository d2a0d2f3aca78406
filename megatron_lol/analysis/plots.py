"""PNG figures of the routing analyses (matplotlib, Agg backend, imported lazily)."""

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


def utilisation_heatmap(counts: torch.Tensor, path: str, title: str = "") -> None:
    """Depth x block heatmap, each cell the percentage of that depth's windows (paper Fig. 4)."""
    plt = _plt()
    share = counts.double() / counts.sum(1, keepdim=True).clamp(min=1)
    D, L = share.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * L, 1.0 + 0.45 * D))
    im = ax.imshow(100 * share.numpy(), cmap="viridis", vmin=0, vmax=100, aspect="auto")
    for d in range(D):
        for m in range(L):
            v = 100 * share[d, m].item()
            ax.text(m, d, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.set_xticks(range(L), [f"E{m}" for m in range(L)])
    ax.set_yticks(range(D), [f"L{d}" for d in range(D)])
    ax.set_xlabel("block")
    ax.set_ylabel("routed depth")
    ax.set_title(title or "block utilisation (% of windows per depth)", fontsize=9)
    fig.colorbar(im, ax=ax, label="% of windows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pca_scatter(coords: torch.Tensor, labels: Optional[Sequence], path: str, ratio: Optional[torch.Tensor] = None,
                title: str = "") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    labels = list(labels) if labels is not None else ["all"] * coords.shape[0]
    names = sorted(set(labels), key=str)
    for name in names:
        idx = [i for i, lab in enumerate(labels) if lab == name]
        ax.scatter(coords[idx, 0].numpy(), coords[idx, 1].numpy(), s=12, alpha=0.7, label=str(name))
    if len(names) > 1:
        ax.legend(fontsize=7, markerscale=1.5, loc="best")
    pc = ["PC1", "PC2"]
    if ratio is not None:
        pc = [f"PC{i + 1} ({100 * float(r):.0f}%)" for i, r in enumerate(ratio[:2])]
    ax.set_xlabel(pc[0])
    ax.set_ylabel(pc[1])
    ax.set_title(title or "routing paths (one-hot per depth x window), PCA", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def distinct_histogram(hist: dict, expected: float, mean: float, path: str, title: str = "") -> None:
    plt = _plt()
    ks = sorted(int(k) for k in hist)
    total = max(1, sum(hist.values()))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(ks, [100 * hist[str(k)] / total for k in ks], color="tab:blue", alpha=0.8, label="token paths")
    ax.axvline(expected, color="tab:red", ls="--", label=f"E[U] uniform = {expected:.2f}")
    ax.axvline(mean, color="black", ls=":", label=f"mean = {mean:.2f}")
    ax.set_xlabel("distinct blocks on a path")
    ax.set_ylabel("% of token paths")
    ax.set_xticks(ks)
    ax.legend(fontsize=7)
    ax.set_title(title or "distinct blocks per routing path", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_pass_metrics(by_pass: Sequence[dict], path: str, title: str = "") -> None:
    """B2 and MMR per loop pass (Foil, seed 002 Figure 5 style)."""
    plt = _plt()
    passes = [p["pass"] + 1 for p in by_pass]
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3))
    a.plot(passes, [p["b2"] for p in by_pass], "o-", color="tab:blue")
    a.set_xlabel("pass")
    a.set_ylabel("load balance B2")
    b.plot(passes, [p["mmr"] for p in by_pass], "o-", color="tab:red")
    b.set_xlabel("pass")
    b.set_ylabel("median margin ratio")
    for ax in (a, b):
        ax.set_xticks(passes)
    fig.suptitle(title or "routing per pass", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def loss_by_budget(losses: dict, path: str, title: str = "") -> None:
    """Validation loss against Accordion's budget k (24 + k layer executions)."""
    plt = _plt()
    ks = sorted(int(k) for k in losses)
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot(ks, [losses[str(k)] for k in ks], "o-", color="tab:green")
    ax.set_xticks(ks)
    ax.set_xlabel("budget k (extra layer executions)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title or "loss per budget", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
