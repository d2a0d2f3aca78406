"""The 4-primitive program task of the blog article "Library of Layers: a transformer that picks
its own layer order" (Satyajit Ghana; section "A toy library on CPU"), in plain PyTorch.

Task: 8 digits mod 10 and a 3-step program; each step is one primitive
``inc`` (+1 to every digit), ``rev`` (reverse), ``rot`` (rotate left by one),
``mul3`` (x3 mod 10). 64 programs; 48 trained, 16 held out, split so that every
primitive appears at every step in the trained programs. Program tokens are
step-specific (token ``10 + 4*step + primitive``), so a mean over tokens still
says which primitive sits at which step. Accuracy is the exact match of all 8
output digits on fresh examples.

Models: a 64-wide, 4-head pre-norm encoder (MLP hidden 256) with 3 block
applications, differing only in which block runs at each step:

``dense``          3 distinct blocks in a fixed order (gate 1)
``looped``         1 block applied 3 times
``oracle``         4 blocks, step l runs the block numbered by its primitive (routing given)
``step_prim``      12 blocks, one per (step, primitive); no block reused across depth
``relabel``        4 blocks, steps 2 and 3 use another primitive->block map than step 1
``program_id``     4 blocks, each of the 64 programs has a fixed random path
``lol``            L blocks, learned top-1 router (tied or untied), as in the released code:
                   input 1/2 (mean hidden + e_l), learned softplus noise (training only),
                   loss-free balancing bias used only to choose (global over depths,
                   u = 1e-3, stops at 96.6% of training), update x + a (E(x) - x)
``lol_router_only``like ``lol`` but the blocks never see the program tokens; the router
                   gets the mean of their embeddings added to its input (the paper's
                   sudoku/maze setup)

Choices the article does not record (written down here): sequence = 3 program tokens then
8 digits with learned position embeddings; a final LayerNorm and a 10-way head on the
8 digit positions; GELU MLP; router logits weights N(0, 0.02), noise weights zero;
the per-depth vectors ``e_l`` N(0, 0.02); program-id paths are drawn from the run
seed; held-out split drawn with ``split_seed`` (default 0) until the coverage property
holds; ``relabel`` uses the cyclic maps ``block = (primitive + step) mod 4``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

PRIMITIVES = ("inc", "rev", "rot", "mul3")
N_DIGITS = 8
N_STEPS = 3
N_PRIMS = len(PRIMITIVES)
PROGRAM_TOKEN0 = 10
VOCAB = PROGRAM_TOKEN0 + N_STEPS * N_PRIMS  # 22
SEQ = N_STEPS + N_DIGITS  # 11


# ----------------------------------------------------------------------------- task
def apply_primitive(prim: int, x: torch.Tensor) -> torch.Tensor:
    """Apply primitive ``prim`` to digit rows ``x`` [B, 8] (long)."""
    if prim == 0:
        return (x + 1) % 10
    if prim == 1:
        return x.flip(-1)
    if prim == 2:
        return x.roll(-1, dims=-1)
    if prim == 3:
        return (x * 3) % 10
    raise ValueError(f"unknown primitive {prim}")


def run_program(program, x: torch.Tensor) -> torch.Tensor:
    """``program`` = (p1, p2, p3): apply p1, then p2, then p3."""
    for p in program:
        x = apply_primitive(int(p), x)
    return x


def all_programs() -> list:
    return list(itertools.product(range(N_PRIMS), repeat=N_STEPS))


def covers_every_step(programs) -> bool:
    """Every primitive appears at every step in ``programs``."""
    return all({p[s] for p in programs} == set(range(N_PRIMS)) for s in range(N_STEPS))


def split_programs(split_seed: int = 0, n_heldout: int = 16) -> tuple:
    """``(trained, heldout)``: lists of program tuples (48 / 16 by default), drawn with
    ``split_seed`` until every primitive appears at every step among the trained ones."""
    progs = all_programs()
    g = torch.Generator().manual_seed(split_seed)
    while True:
        perm = torch.randperm(len(progs), generator=g).tolist()
        held = sorted(progs[i] for i in perm[:n_heldout])
        trained = sorted(progs[i] for i in perm[n_heldout:])
        if covers_every_step(trained):
            return trained, held


def program_index(program) -> int:
    p1, p2, p3 = program
    return (p1 * N_PRIMS + p2) * N_PRIMS + p3


def make_batch(programs, n: int, generator: torch.Generator) -> dict:
    """``n`` fresh examples, programs uniform over ``programs``.

    Returns ``tokens`` [n, 11] (program tokens then digits), ``targets`` [n, 8],
    ``program`` [n, 3] (primitive per step) and ``program_id`` [n] (0..63).
    """
    table = torch.tensor(programs, dtype=torch.long)  # [P, 3]
    pick = torch.randint(len(programs), (n,), generator=generator)
    prog = table[pick]
    digits = torch.randint(10, (n, N_DIGITS), generator=generator)
    out = digits.clone()
    for s in range(N_STEPS):
        for p in range(N_PRIMS):
            rows = prog[:, s] == p
            if rows.any():
                out[rows] = apply_primitive(p, out[rows])
    prog_tokens = PROGRAM_TOKEN0 + N_PRIMS * torch.arange(N_STEPS) + prog
    pid = (prog[:, 0] * N_PRIMS + prog[:, 1]) * N_PRIMS + prog[:, 2]
    return {"tokens": torch.cat([prog_tokens, digits], dim=1), "targets": out, "program": prog, "program_id": pid}


# ----------------------------------------------------------------------------- models
class Block(nn.Module):
    """Pre-norm transformer encoder block (bidirectional attention, GELU MLP)."""

    def __init__(self, width: int = 64, heads: int = 4, mlp: int = 256):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp)
        self.fc2 = nn.Linear(mlp, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Router(nn.Module):
    """The router of the released Library of Layers code: linear logits, learned softplus noise, softmax."""

    def __init__(self, width: int, n_blocks: int):
        super().__init__()
        self.logits = nn.Linear(width, n_blocks)
        self.noise = nn.Linear(n_blocks, n_blocks)
        nn.init.normal_(self.logits.weight, std=0.02)
        nn.init.zeros_(self.logits.bias)
        nn.init.zeros_(self.noise.weight)
        nn.init.zeros_(self.noise.bias)

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        z = self.logits(r.float())
        if self.training:
            z = z + torch.randn_like(z) * F.softplus(self.noise(z)).clamp(max=10.0)
        return z.softmax(-1)


FIXED_KINDS = ("dense", "looped", "oracle", "step_prim", "relabel", "program_id")
LEARNED_KINDS = ("lol", "lol_router_only")


@dataclass
class ModelSpec:
    kind: str
    n_blocks: int = 4
    tied: bool = True
    width: int = 64
    heads: int = 4
    mlp: int = 256

    @property
    def label(self) -> str:
        if self.kind in LEARNED_KINDS:
            return f"{self.kind}-L{self.n_blocks}-{'tied' if self.tied else 'untied'}"
        return self.kind


def default_blocks(kind: str) -> int:
    return {"dense": 3, "looped": 1, "oracle": 4, "step_prim": 12, "relabel": 4, "program_id": 4}.get(kind, 4)


class ToyModel(nn.Module):
    def __init__(self, spec: ModelSpec, seed: int = 0):
        super().__init__()
        if spec.kind not in FIXED_KINDS + LEARNED_KINDS:
            raise ValueError(f"unknown model kind {spec.kind!r}")
        self.spec = spec
        d = spec.width
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, spec.heads, spec.mlp) for _ in range(spec.n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)
        self.learned = spec.kind in LEARNED_KINDS
        if self.learned:
            n_routers = 1 if spec.tied else N_STEPS
            self.routers = nn.ModuleList(Router(d, spec.n_blocks) for _ in range(n_routers))
            self.depth_vec = nn.Parameter(torch.randn(N_STEPS, d) * 0.02)
            self.register_buffer("bias", torch.zeros(spec.n_blocks))
        if spec.kind == "program_id":
            g = torch.Generator().manual_seed(10_000 + seed)
            self.register_buffer("id_paths", torch.randint(spec.n_blocks, (N_PRIMS**N_STEPS, N_STEPS), generator=g))
        self.last_choices: Optional[torch.Tensor] = None  # [B, 3]
        self.last_loads: Optional[torch.Tensor] = None  # [3, L]

    def fixed_path(self, batch: dict) -> torch.Tensor:
        """Block per (example, step) for the routing-given kinds: [B, 3]."""
        prog = batch["program"]
        b = prog.shape[0]
        kind = self.spec.kind
        if kind == "dense":
            return torch.arange(N_STEPS).expand(b, N_STEPS)
        if kind == "looped":
            return torch.zeros(b, N_STEPS, dtype=torch.long)
        if kind == "oracle":
            return prog
        if kind == "step_prim":
            return prog + N_PRIMS * torch.arange(N_STEPS)
        if kind == "relabel":
            return (prog + torch.arange(N_STEPS)) % N_PRIMS
        if kind == "program_id":
            return self.id_paths[batch["program_id"]]
        raise AssertionError(kind)

    def _run_blocks(self, x, choice, gate):
        """x [B, S, d]; per example block ``choice`` [B] and gate [B] (None: update = E(x))."""
        out = torch.empty_like(x)
        for m in torch.unique(choice).tolist():
            idx = (choice == m).nonzero(as_tuple=True)[0]
            xs = x.index_select(0, idx)
            ys = self.blocks[m](xs)
            if gate is not None:
                ys = xs + gate.index_select(0, idx).view(-1, 1, 1) * (ys - xs)
            out.index_copy_(0, idx, ys)
        return out

    def forward(self, batch: dict) -> torch.Tensor:
        """Logits [B, 8, 10] for the 8 output digits."""
        tokens = batch["tokens"]
        x = self.embed(tokens) + self.pos
        router_extra = None
        if self.spec.kind == "lol_router_only":
            router_extra = x[:, :N_STEPS].mean(1)  # the program reaches the router only
            x = x[:, N_STEPS:]
        choices, loads = [], []
        path = None if self.learned else self.fixed_path(batch)
        for step in range(N_STEPS):
            if self.learned:
                router = self.routers[0 if self.spec.tied else step]
                r = 0.5 * (x.mean(1) + self.depth_vec[step])
                if router_extra is not None:
                    r = r + router_extra
                a = router(r)
                choice = (a.detach() + self.bias).argmax(-1)
                gate = a.gather(-1, choice[:, None]).squeeze(-1).to(x.dtype)
                x = self._run_blocks(x, choice, gate)
            else:
                choice = path[:, step]
                x = self._run_blocks(x, choice, None)
            choices.append(choice)
            loads.append(torch.bincount(choice, minlength=self.spec.n_blocks))
        self.last_choices = torch.stack(choices, 1)
        self.last_loads = torch.stack(loads)
        x = self.ln_f(x)
        return self.head(x[:, -N_DIGITS:])

    @torch.no_grad()
    def update_bias(self, speed: float = 1e-3) -> None:
        """Loss-free balancing after an optimizer step: loads summed over depths (global)."""
        if not self.learned or self.last_loads is None:
            return
        load = self.last_loads.sum(0).float()
        self.bias -= speed * torch.sign(load - load.mean())
        self.bias.clamp_(-16.0, 16.0)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    steps: int = 3000
    batch: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    clip: float = 1.0
    eval_examples: int = 4096
    bias_speed: float = 1e-3
    bias_stop_fraction: float = 0.966
    split_seed: int = 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def evaluate(model: ToyModel, programs, n: int, seed: int, batch: int = 1024) -> dict:
    """Exact-match accuracy on ``n`` fresh examples of ``programs``, plus the routing
    statistics of learned routers (separation, depth concentration; the article's round two)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    correct, choices, prims = 0, [], []
    for start in range(0, n, batch):
        b = make_batch(programs, min(batch, n - start), g)
        pred = model(b).argmax(-1)
        correct += int((pred == b["targets"]).all(-1).sum())
        choices.append(model.last_choices)
        prims.append(b["program"])
    out = {"accuracy": correct / n}
    if model.learned:
        out.update(routing_stats(torch.cat(choices), torch.cat(prims), model.spec.n_blocks))
    model.train()
    return out


def routing_stats(choices: torch.Tensor, prims: torch.Tensor, n_blocks: int) -> dict:
    """Separation: share of examples whose block's most common primitive (at that step) is
    their own, mean over steps (0.25 = blind, 1 = oracle). Depth concentration: share of
    each block's use at its busiest step, averaged over blocks weighted by use."""
    sep = []
    for s in range(N_STEPS):
        counts = torch.zeros(n_blocks, N_PRIMS)
        counts.index_put_((choices[:, s], prims[:, s]), torch.ones(len(choices)), accumulate=True)
        sep.append(float(counts.max(1).values.sum() / len(choices)))
    use = torch.stack([torch.bincount(choices[:, s], minlength=n_blocks) for s in range(N_STEPS)]).float()  # [3, L]
    conc = float(use.max(0).values.sum() / use.sum())
    return {"separation": sum(sep) / N_STEPS, "depth_concentration": conc}


def train_one(spec: ModelSpec, seed: int, cfg: TrainConfig, threads: int = 1, log_every: int = 0) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    trained, held = split_programs(cfg.split_seed)
    model = ToyModel(spec, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1))
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = make_batch(trained, cfg.batch, g)
        logits = model(batch)
        loss = F.cross_entropy(logits.reshape(-1, 10), batch["targets"].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        if step < cfg.bias_stop_fraction * cfg.steps:
            model.update_bias(cfg.bias_speed)
        if log_every and (step + 1) % log_every == 0:
            print(f"  {spec.label} seed {seed} step {step + 1} loss {loss.item():.4f}", flush=True)
    train_s = time.perf_counter() - t0
    tr = evaluate(model, trained, cfg.eval_examples, seed=7_000 + seed)
    ho = evaluate(model, held, cfg.eval_examples, seed=8_000 + seed)
    res = {
        "model": spec.label,
        "seed": seed,
        "params": count_params(model),
        "train_acc": tr["accuracy"],
        "heldout_acc": ho["accuracy"],
        "final_loss": float(loss.item()),
        "seconds": train_s,
        "steps": cfg.steps,
    }
    for k in ("separation", "depth_concentration"):
        if k in ho:
            res[k] = ho[k]
    return res
