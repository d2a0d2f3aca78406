"""Deprecated spellings of the ``model`` section, rewritten to the plan's section (the one table).

A plan kind's options live in ``model.plan`` (``plan: {kind: foil, experts: 8,
layers: 8, loops: 2}``). Two earlier spellings are read, with a
:class:`ConfigDeprecationWarning`, and rewritten here before anything else
sees the config, so that configs and checkpoints' ``run_config.yaml`` of
earlier versions load to the same model:

* the options as flat ``model`` keys (:data:`FLAT_KEYS`): ``model.loop_window``
  for ``model.plan.window``; a ``run_config.yaml`` of that version holds every
  kind's keys, the unused ones at their defaults (dropped here);
* the older shape keys: ``num_blocks`` / ``routed_depth`` for every kind, Foil
  as ``plan: looped`` with MoE blocks (``moe.layers: all``)::

    plan        deprecated keys                    current keys
    dense       num_blocks                         plan.layers
    looped      num_blocks, routed_depth           plan.layers, plan.loops (= routed_depth / num_blocks)
    looped with num_blocks, routed_depth,          plan: foil, plan.layers, plan.loops,
    MoE blocks  moe.core_num_experts               plan.experts (default moe.num_experts)
    accordion   num_blocks                         plan.window

* the MoE and precision settings as flat ``model`` keys (:data:`MOVED_KEYS`):
  ``model.num_experts`` for ``model.moe.num_experts``, ``model.moe_router_topk``
  for ``model.moe.router_topk``, ``model.params_dtype`` for
  ``model.precision.params_dtype``, ``model.use_transformer_engine`` for
  ``model.precision.transformer_engine``;
* the window router's and its balancing's settings as flat ``model`` keys
  (:data:`ROUTING_KEYS`): ``model.balancing`` for ``model.plan.routing.balancing``
  (for a kind without a router: dropped, except router-only tokens, refused as before);
* the windows, the fixed kinds' attention, FiLM and input injection as flat ``model`` keys
  (:data:`OPTION_KEYS`): ``model.window_size`` for ``model.plan.windows.size``,
  ``model.dense_attention`` for ``model.plan.attention``, ``model.film`` for ``model.plan.film``
  (for a kind without the option: dropped at the old default, refused otherwise);
* how the model runs, as ``model`` keys (:data:`RUNTIME_KEYS`): ``model.routed_core``
  for ``parallel.routed_core`` (:func:`migrate_runtime`, on the whole config: it
  moves across sections).

This module is the only one in the package that names an option by its flat
key (tests/test_config_migration.py scans for the others); the loader calls
:func:`migrate_model` on a raw ``model`` mapping, :func:`set_flat_key` for
``--set model.<flat key>=...``, and ``ModelConfig(<flat key>=...)`` goes through
:func:`migrate_model` too.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

from megatron_lol.errors import ConfigError

#: flat ``model`` key -> (the kinds whose option it is, the option's key in their section)
FLAT_KEYS = {
    "num_blocks": (("lol",), "num_blocks"),
    "routed_depth": (("lol",), "routed_depth"),
    "core_layers": (("dense",), "layers"),
    "loop_layers": (("looped",), "layers"),
    "loop_count": (("looped",), "loops"),
    "foil_experts": (("foil",), "experts"),
    "foil_layers": (("foil",), "layers"),
    "foil_loops": (("foil",), "loops"),
    "untie_attention": (("looped", "foil"), "untie_attention"),
    "loop_window": (("accordion",), "window"),
    "loop_budgets": (("accordion",), "budgets"),
    "loop_budget": (("accordion",), "budget"),
    "second_pass_router": (("accordion",), "second_pass_router"),
    "loop_gates": (("accordion",), "gates"),
}


#: flat ``model`` key -> (the sub-section of ``model`` it moved to, its key there)
MOVED_KEYS = {
    "num_experts": ("moe", "num_experts"),
    "moe_ffn_hidden_size": ("moe", "ffn_hidden_size"),
    "moe_router_topk": ("moe", "router_topk"),
    "moe_layers": ("moe", "layers"),
    "core_num_experts": ("moe", "core_num_experts"),
    "moe_shared_expert_intermediate_size": ("moe", "shared_expert_intermediate_size"),
    "moe_aux_loss_coeff": ("moe", "aux_loss_coeff"),
    "moe_z_loss_coeff": ("moe", "z_loss_coeff"),
    "moe_router_score_function": ("moe", "router_score_function"),
    "moe_router_enable_expert_bias": ("moe", "router_enable_expert_bias"),
    "moe_router_bias_update_rate": ("moe", "router_bias_update_rate"),
    "moe_loss_average_over_executions": ("moe", "loss_average_over_executions"),
    "params_dtype": ("precision", "params_dtype"),
    "use_transformer_engine": ("precision", "transformer_engine"),
    "fp8": ("precision", "fp8"),
    "fp8_recipe": ("precision", "fp8_recipe"),
    "fp8_margin": ("precision", "fp8_margin"),
    "fp8_amax_history_len": ("precision", "fp8_amax_history_len"),
    "fp8_amax_compute_algo": ("precision", "fp8_amax_compute_algo"),
}


#: flat ``model`` keys of the window router and its balancing: now keys of ``model.plan.routing``, the
#: sub-section of the kinds that route (:mod:`megatron_lol.plan.routing`), under the same names
ROUTING_KEYS = (
    "router_tied",
    "router_noise",
    "router_noise_clamp",
    "router_input",
    "router_only_tokens",
    "router_only_filler",
    "balancing",
    "bias_update_speed",
    "bias_clamp",
    "bias_update_stop_fraction",
    "per_depth_bias",
    "seq_aux_loss_coeff",
    "aux_loss_coeff",
)


#: flat ``model`` keys that are now options of the kinds that have them (:mod:`megatron_lol.plan.windows`,
#: :mod:`megatron_lol.plan.pass_parts`) -> (their dotted key under ``model.plan``, the flat key's default)
OPTION_KEYS = {
    "window_size": ("windows.size", 32),
    "window_shift": ("windows.shift", 16),
    "dense_attention": ("attention", "full"),
    "film": ("film", "off"),
    "input_injection": ("input_injection", False),
}


#: ``model`` keys that say how the model runs, not what it computes -> (the section they moved to, their key)
RUNTIME_KEYS = {"routed_core": ("parallel", "routed_core")}


#: the defaults of the flat keys that had one (the others defaulted to null): a run_config.yaml of that
#: version lists every kind's keys, and these values of another kind's keys mean "not set"
FLAT_DEFAULTS = {"loop_budgets": [0], "second_pass_router": "shared", "loop_gates": True}


class ConfigDeprecationWarning(FutureWarning):
    """A config key in a deprecated spelling (read and rewritten)."""


def _warn(message: str) -> None:
    warnings.warn(f"config: {message}", ConfigDeprecationWarning, stacklevel=5)


def migrate_model(model: dict, source: str, override: bool = False) -> dict:
    """``model`` (a raw mapping of the ``model`` section) in the current layout: the flat MoE /
    precision keys in their sub-sections, the flat plan keys in ``model.plan``, the flat router and
    balancing keys in ``model.plan.routing`` (deprecation warnings); unchanged when already current.

    ``override``: the flat keys replace the section's values (``--set model.<flat key>``,
    ``dataclasses.replace``); otherwise a flat key and a different section value are refused.
    """
    model = migrate_sections(model, source, override)
    model = _migrate_plan_keys(model, source, override)
    model = migrate_routing(model, source, override)
    return migrate_options(model, source, override)


def migrate_options(model: dict, source: str, override: bool = False) -> dict:
    """``model`` with the flat window / attention / FiLM / injection keys (:data:`OPTION_KEYS`) moved
    into the plan's section (a deprecation warning each). For a kind without the option: dropped
    silently at the old default (a ``run_config.yaml`` of that version lists every key); otherwise
    refused as that version refused it (attention other than full for lol and accordion, FiLM and
    injection for accordion), except a window geometry, which that version took with any kind and
    never used: dropped with a warning."""
    if not OPTION_KEYS.keys() & model.keys():
        return model
    from megatron_lol.plan import PLANS

    flat, out, section, kind, cls = _flat_keys_and_plan(model, OPTION_KEYS)
    own = {f.name for f in fields(cls.Options)} if cls is not None else set()
    for key, value in flat.items():
        path, default = OPTION_KEYS[key]
        head, _, sub = path.partition(".")
        if head not in own:
            if value == default:
                continue  # a run_config.yaml of that version lists every key
            if head == "windows":  # that version took (and never used) a window geometry with any kind
                _warn(f"{source}: model.{key} is deprecated, and plan {kind} has no windows: dropped")
                continue
            kinds = [name for name, c in PLANS.items() if head in {f.name for f in fields(c.Options)}]
            raise ConfigError(
                f"{source}: model.{key}={value!r}: not used by plan {kind} (an option of plan "
                f"{' / '.join(kinds)}, model.plan.{path})"
            )
        holder = section
        if sub:
            holder = section[head] = _section_values(section.get(head))
        name = sub or head
        written = holder.get(name)
        if not override and name in holder and written != value and _was_written(model.get("plan"), path):
            raise ConfigError(
                f"{source}: model.{key}={value!r} given together with model.plan.{path}={written!r}; remove model.{key}"
            )
        holder[name] = value
        _warn(f"{source}: model.{key} is deprecated; write it as model.plan.{path}")
    out["plan"] = section
    return out


def _was_written(plan: Any, path: str) -> bool:
    """Whether the plan as written (a mapping) gives the dotted option ``path`` itself."""
    for part in path.split("."):
        if not isinstance(plan, dict) or part not in plan:
            return False
        plan = plan[part]
    return True


def _flat_keys_and_plan(model: dict, keys) -> tuple:
    """``(flat, rest, plan, kind, kind class)``: the keys of ``keys`` that ``model`` gives flat, the rest of
    ``model``, its plan as a ``{kind: ..., ...}`` mapping, the plan's kind and its registered class (or None)."""
    from megatron_lol.plan import PLANS

    flat = {k: model[k] for k in keys if k in model}
    rest = {k: v for k, v in model.items() if k not in keys}
    section = _plan_mapping(model.get("plan", "lol"))
    kind = section.get("kind")
    return flat, rest, section, kind, PLANS.get(kind)


def _plan_mapping(plan: Any) -> dict:
    """The plan as ``{kind: ..., ...}``, from a name, a mapping or a section object."""
    if isinstance(plan, dict):
        return dict(plan)
    if isinstance(plan, str):
        return {"kind": plan}
    from megatron_lol.plan.execution import section_dict

    return section_dict(plan)


def migrate_routing(model: dict, source: str, override: bool = False) -> dict:
    """``model`` with the flat router / balancing keys (:data:`ROUTING_KEYS`) moved into the plan's
    ``routing`` sub-section (a deprecation warning each). For a kind without a router they are
    dropped: silently at their defaults (a ``run_config.yaml`` of that version lists them), with a
    warning at other values (that version took them with any kind, unused), except the
    router-only tokens, which it refused for such kinds and which are refused here too."""
    if not set(ROUTING_KEYS) & model.keys():
        return model
    flat, out, section, kind, cls = _flat_keys_and_plan(model, ROUTING_KEYS)
    if cls is None or "routing" not in {f.name for f in fields(cls.Options)}:
        from megatron_lol.plan.routing import RoutingOptions

        defaults = RoutingOptions()
        for key, value in flat.items():
            if value == getattr(defaults, key):
                continue  # at its default: a run_config.yaml of that version lists every key
            if key.startswith("router_only"):  # refused for such kinds in that version too
                raise ConfigError(
                    f"{source}: model.{key}: plan {kind} has no window router (a key of "
                    f"model.plan.routing of a kind that routes, e.g. lol)"
                )
            # that version took (and never used) the other router keys with any kind
            _warn(f"{source}: model.{key} is deprecated, and plan {kind} has no window router: dropped")
        return out
    written = section.get("routing")
    routing = _section_values(written)
    for key, value in flat.items():
        if not override and isinstance(written, dict) and key in written and written[key] != value:
            raise ConfigError(
                f"{source}: model.{key}={value!r} given together with model.plan.routing.{key}={written[key]!r}; "
                f"remove model.{key}"
            )
        routing[key] = value
        _warn(f"{source}: model.{key} is deprecated; write it as model.plan.routing.{key}")
    section["routing"] = routing
    out["plan"] = section
    return out


def _migrate_plan_keys(model: dict, source: str, override: bool = False) -> dict:
    """``model`` with every flat plan key moved into ``model.plan`` as ``{kind: ..., ...}``."""
    flat = {k: model[k] for k in FLAT_KEYS if k in model}
    if not flat:
        return model
    out = {k: v for k, v in model.items() if k not in FLAT_KEYS}
    section = _plan_mapping(model.get("plan", "lol"))
    kind = section.get("kind")
    flat = {k: v for k, v in flat.items() if v is not None}  # unset: means nothing in any spelling
    kind = _older_shape_keys(kind, flat, section, out)
    for key, value in flat.items():
        kinds, option = FLAT_KEYS[key]
        if kind not in kinds:
            if key in FLAT_DEFAULTS and value == FLAT_DEFAULTS[key]:
                continue  # a run_config.yaml of the flat version lists every kind's options
            raise ConfigError(
                f"{source}: model.{key}: not used by plan {kind} (an option of plan {' / '.join(kinds)}, "
                f"model.plan.{option})"
            )
        written = section.get(option)
        if not override and written is not None and written != value:
            raise ConfigError(
                f"{source}: model.{key}={value!r} given together with model.plan.{option}={written!r}; "
                f"remove model.{key}"
            )
        section[option] = value
        _warn(
            f"{source}: model.{key} is deprecated; write it in the plan's section "
            f"(model.plan: {{kind: {kind}, {option}: ...}})"
        )
    section["kind"] = kind
    out["plan"] = section
    return out


def _older_shape_keys(kind: str, flat: dict, section: dict, out: dict) -> str:
    """The shape in ``num_blocks`` / ``routed_depth`` for a kind other than lol: rewritten into
    the kind's section (``flat``, ``section`` and ``out`` in place); the kind it reads as."""
    if kind in ("lol", None) or not ({"num_blocks", "routed_depth"} & set(flat)):
        return kind
    blocks, depth = flat.get("num_blocks"), flat.get("routed_depth")
    own = {"dense": ("core_layers", "layers"), "accordion": ("loop_window", "window")}
    if kind in own:
        old_key, option = own[kind]
        if old_key in flat or section.get(option) is not None:
            return kind  # the kind's own key is given: num_blocks is a stray key, refused below
        flat.pop("routed_depth", None)  # always ignored by these plans
        if blocks is not None:
            section[option] = flat.pop("num_blocks")
            _warn(f"plan {kind}: model.num_blocks is now model.plan.{option} (={blocks})")
        return kind
    if kind != "looped" or {"loop_layers", "loop_count"} & set(flat) or section.get("layers") is not None:
        return kind
    if blocks is None or depth is None:
        raise ConfigError(
            f"model.{'num_blocks' if blocks is None else 'routed_depth'}: the older looped spelling needs "
            f"both num_blocks and routed_depth (better: model.plan: {{kind: looped, layers: ..., loops: ...}})"
        )
    if depth % blocks:
        raise ConfigError(
            f"model.routed_depth: a looped plan needs routed_depth ({depth}) to be a multiple of num_blocks ({blocks})"
        )
    del flat["num_blocks"], flat["routed_depth"]
    section.update(layers=blocks, loops=depth // blocks)
    moe = out["moe"] = _section_values(out.get("moe"))  # a mapping as written, or a section object
    if moe.get("layers") == "all":
        kind = "foil"
        experts = moe.pop("core_num_experts", None) or moe.get("num_experts")
        if section.get("experts") is None:
            section["experts"] = experts
        if section.get("untie_attention") is None and flat.get("untie_attention") is None:
            section["untie_attention"] = False  # the default of this spelling
    _warn(
        f"plan looped{' with MoE blocks is now plan foil;' if kind == 'foil' else ':'} "
        f"num_blocks / routed_depth are now model.plan.layers={blocks} / model.plan.loops={depth // blocks}"
    )
    return kind


def _section_values(section: Any) -> dict:
    """A sub-section as written (a mapping), or as read (its dataclass), as a new mapping."""
    if section is None:
        return {}
    if isinstance(section, dict):
        return dict(section)
    from megatron_lol.checks import asdict

    return asdict(section)


def migrate_sections(model: dict, source: str, override: bool = False) -> dict:
    """``model`` with every flat MoE / precision key (:data:`MOVED_KEYS`) moved into its sub-section
    (``model.moe``, ``model.precision``; deprecation warnings); unchanged without such keys.
    ``override``: as for :func:`migrate_model`."""
    flat = {k: model[k] for k in MOVED_KEYS if k in model}
    if not flat:
        return model
    out = {k: v for k, v in model.items() if k not in MOVED_KEYS}
    sections: dict = {}
    for key, value in flat.items():
        name, new = MOVED_KEYS[key]
        if name not in sections:
            sections[name] = _section_values(out.get(name))
        written = out.get(name)  # a value the user wrote in the section itself (not a default)
        if not override and isinstance(written, dict) and new in written and written[new] != value:
            raise ConfigError(
                f"{source}: model.{key}={value!r} given together with model.{name}.{new}={written[new]!r}; "
                f"remove model.{key}"
            )
        sections[name][new] = value
        _warn(f"{source}: model.{key} is deprecated; write it as model.{name}.{new}")
    out.update(sections)
    return out


def migrate_runtime(raw: dict, source: str) -> dict:
    """The whole config ``raw`` with each ``model`` key of :data:`RUNTIME_KEYS` moved to its section
    (``model.routed_core`` -> ``parallel.routed_core``; a deprecation warning each); a value given in both
    places differently is refused. Unchanged without such keys."""
    model = raw.get("model")
    if not isinstance(model, dict) or not RUNTIME_KEYS.keys() & model.keys():
        return raw
    out = dict(raw)
    out["model"] = {k: v for k, v in model.items() if k not in RUNTIME_KEYS}
    for key in RUNTIME_KEYS.keys() & model.keys():
        name, new = RUNTIME_KEYS[key]
        section = out.get(name)
        section = dict(section) if isinstance(section, dict) else {}
        if new in section and section[new] != model[key]:
            raise ConfigError(
                f"{source}: model.{key}={model[key]!r} given together with {name}.{new}={section[new]!r}; "
                f"remove model.{key}"
            )
        section[new] = model[key]
        out[name] = section
        _warn(f"{source}: model.{key} is deprecated; write it as {name}.{new} (how the model runs)")
    return out


def runtime_key(key: str, source: str) -> str:
    """``--set model.<key>=...`` of a :data:`RUNTIME_KEYS` key: its dotted key now (deprecation)."""
    name, new = RUNTIME_KEYS[key]
    _warn(f"{source}: model.{key} is deprecated; write it as {name}.{new} (how the model runs)")
    return f"{name}.{new}"


def refuse_runtime_key(key: str, source: str) -> None:
    """A :data:`RUNTIME_KEYS` key given to the ``model`` section alone (``ModelConfig(routed_core=...)``):
    one line naming where it lives, since the model section cannot carry it over."""
    name, new = RUNTIME_KEYS[key]
    raise ConfigError(
        f"{source}: model.{key} says how the model runs, not what it computes; it lives in {name}.{new} "
        f"(ParallelConfig({new}=...), LoLGPTModel(parallel=...))"
    )


def moved_key(key: str, source: str) -> str:
    """``--set model.<flat key>=...`` of a moved MoE / precision key: its dotted key now (deprecation)."""
    name, new = MOVED_KEYS[key]
    _warn(f"{source}: model.{key} is deprecated; write it as model.{name}.{new}")
    return f"model.{name}.{new}"


def set_flat_key(model, key: str, value: Any, source: str) -> None:
    """``--set model.<flat key>=VALUE``: the option of the current plan (deprecation warning)."""
    if key in ROUTING_KEYS:
        _warn(f"{source}: model.{key} is deprecated; write it as model.plan.routing.{key}")
        model.set_plan_option(key, value, source, sub="routing")
        return
    if key in OPTION_KEYS:
        migrated = migrate_options({"plan": model.plan, key: value}, source, override=True)
        if migrated["plan"] is not model.plan:
            model.read_plan_section(migrated["plan"], source)
        return
    migrated = migrate_model({"plan": model.plan, key: value}, source, override=True)
    model.read_plan_section(migrated["plan"], source)
