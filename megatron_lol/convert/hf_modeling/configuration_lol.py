"""Configuration of a Library-of-Layers (LoL) causal language model for HuggingFace transformers.

Written by ``megatron-lol convert-hf``; loaded with ``trust_remote_code=True``.
Field names follow HuggingFace conventions where one exists (``hidden_size``,
``intermediate_size``, ``num_key_value_heads``, ``rope_theta``); the LoL knobs
keep the names of megatron-lol's ``model:`` section (``num_blocks`` = L,
``routed_depth`` = D, ``window_size`` = W, ``window_shift`` = S).

FFN mixture of experts (megatron-core ``MoELayer``): ``moe_layers`` says which
layers have one (``none``, ``fixed`` = prelude and coda, ``all`` = also every
core block); ``num_experts`` experts in the prelude / coda layers,
``core_num_experts`` in the core blocks, ``num_experts_per_tok`` = top-k,
``moe_intermediate_size`` = one expert's SwiGLU width and
``shared_expert_intermediate_size`` an always-on shared expert (None: none);
``moe_router_score_function`` softmax or sigmoid and ``moe_router_expert_bias`` whether
each MoE router holds a (frozen) expert bias for the top-k choice (megatron-core's).

The core's schedule is ``execution_plan``, written by the exporter: ``steps``,
one per core execution in order, each with the stored ``block`` it runs (None:
routed per window), its ``pass``, its ``attention`` (``window``, ``full``,
``sliding``, ``strided``), whether the pass has its own attention
(``untied_attention``, Foil), its own MoE router (``separate_router``,
Accordion) and the per-pass parts it names (``parts``, e.g. ``loop_gates``;
FiLM and input injection are on for every step when ``film`` /
``input_injection`` say so); ``part_modules``: the parts the export ships as
source (``part_<name>.py``, registered by ``plugin_parts_lol.py``); and, for Accordion, ``depth_for_budget``: how
many of the steps a loop budget runs. The remote code runs these steps; it
does not re-derive them from the other fields.
"""

from transformers import PretrainedConfig

# the parts this export ships (plugin_parts_lol.py, written by the exporter): the config checks it has
# the ones it names, and importing them here makes the config class differ with them, which matters
# because transformers keys an already loaded remote model class by its config class
from .plugin_parts_lol import SHIPPED as SHIPPED_PARTS


class LoLConfig(PretrainedConfig):
    model_type = "lol"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        *,
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        n_prelude=1,
        n_coda=1,
        plan="lol",
        num_blocks=4,
        routed_depth=4,
        window_size=32,
        window_shift=16,
        dense_attention="full",
        router_tied=True,
        router_input="windows",
        router_only_tokens=(),
        router_only_filler=None,
        per_depth_bias=False,
        film="off",
        input_injection=False,
        moe_layers="none",
        num_experts=None,
        core_num_experts=None,
        num_experts_per_tok=2,
        moe_intermediate_size=None,
        shared_expert_intermediate_size=None,
        moe_router_score_function="softmax",
        moe_router_expert_bias=False,
        untie_attention=False,
        loop_budgets=None,
        loop_budget=None,
        second_pass_router="shared",
        loop_gates=True,
        part_modules=None,
        execution_plan=None,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling_factor=1.0,
        max_position_embeddings=4096,
        eod_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.n_prelude = n_prelude
        self.n_coda = n_coda
        self.plan = plan
        self.num_blocks = num_blocks
        self.routed_depth = routed_depth
        self.window_size = window_size
        self.window_shift = window_shift
        self.dense_attention = dense_attention
        self.router_tied = router_tied
        self.router_input = router_input  # "depth": the route reads only the depth embedding
        # ids that reach only the router (the layers see router_only_filler in their place)
        self.router_only_tokens = list(router_only_tokens)
        self.router_only_filler = router_only_filler
        self.per_depth_bias = per_depth_bias
        self.film = film
        self.input_injection = input_injection
        self.moe_layers = moe_layers
        self.num_experts = num_experts
        self.core_num_experts = (
            core_num_experts if core_num_experts is not None else (num_experts if moe_layers == "all" else None)
        )
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.moe_router_score_function = moe_router_score_function
        self.moe_router_expert_bias = bool(moe_router_expert_bias)
        self.untie_attention = untie_attention
        self.loop_budgets = [int(k) for k in loop_budgets] if loop_budgets else [0]
        self.loop_budget = int(loop_budget) if loop_budget is not None else max(self.loop_budgets)
        self.second_pass_router = second_pass_router
        self.loop_gates = loop_gates
        self.execution_plan = execution_plan
        self.part_modules = dict(part_modules or {})
        missing = sorted(set(self.part_modules) - {part.name for part in SHIPPED_PARTS})
        if missing:
            raise ValueError(f"config.json: part_modules names {', '.join(missing)}, which this export does not ship")
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_scaling_factor = rope_scaling_factor
        self.max_position_embeddings = max_position_embeddings
        self.eod_token_id = eod_token_id
        self.initializer_range = initializer_range
        # generic name some tools read for the number of layer executions per token
        self.num_hidden_layers = n_prelude + n_coda + self.core_depth
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def steps(self):
        """The core's steps (``execution_plan["steps"]``); ``[]`` for a config without a plan."""
        return list((self.execution_plan or {}).get("steps", []))

    @property
    def core_depth(self):
        """Core executions of the full plan (Accordion: at its largest budget)."""
        return len(self.steps)

    @property
    def has_budgets(self):
        """Whether the plan has loop budgets (Accordion)."""
        return bool((self.execution_plan or {}).get("depth_for_budget"))

    def resolve_budget(self, loop_budget=None):
        """The loop budget of a call or cache: the given one, else ``loop_budget`` (Accordion);
        None for the other plans, which refuse a given one."""
        if not self.has_budgets:
            if loop_budget is not None:
                raise ValueError(
                    f"loop_budget: only plan accordion has a loop budget (this model's plan is {self.plan})"
                )
            return None
        k = self.loop_budget if loop_budget is None else int(loop_budget)
        if k not in self.loop_budgets:
            raise ValueError(f"loop_budget={k} is not one of the model's loop_budgets {list(self.loop_budgets)}")
        return k

    def depth_for_budget(self, budget):
        """Core steps a loop budget runs (all of them for plans without budgets)."""
        table = (self.execution_plan or {}).get("depth_for_budget")
        if not table:
            return self.core_depth
        return int(table[str(int(budget))])

    @property
    def fixed_layer_experts(self):
        """Experts of a prelude / coda layer's MLP (None: dense SwiGLU)."""
        return self.num_experts if self.moe_layers in ("fixed", "all") else None

    @property
    def block_experts(self):
        """Experts of a core block's MLP (None: dense SwiGLU)."""
        return self.core_num_experts if self.moe_layers == "all" else None
