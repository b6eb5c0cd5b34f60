"""train_ep.py's refusals, one line each, before anything is cut: the built-in GPT's MoE flags
against a 🤗 model (check_moe_flags), the degrees before any process group (check_ep_flags), and,
once the model is built, its experts (check_experts: a 🤗 family's in common/hf_ep.py, a model of
one's own without any, then the slices FSDP cuts them into).
"""

from __future__ import annotations

from .errors import UsageError

BUILT_IN_EXPERTS = 8  # --n_experts when a run names no model: 8 experts per MoE layer
# the built-in GPT's MoE flags: a 🤗 model brings its own router and experts (they would be ignored)
GPT_MOE_FLAGS = ("top_k", "moe_every", "expert_hidden", "shared_expert", "router_score")
GPT_MOE_FLAGS += ("load_balance", "aux_loss_coef", "bias_update_rate", "capacity_factor")
GPT_MOE_FLAGS += ("dump_routing",)


def check_moe_flags(args, parser) -> bool:
    """--n_experts defaults to BUILT_IN_EXPERTS for the built-in GPT, and is refused with a 🤗
    model (its config names its experts), as are the GPT's other MoE flags. Returns whether a 🤗
    model is trained."""
    named = getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None)
    hf_model = bool(named)
    if not hasattr(args, "model_size"):  # a model of one's own: its experts are counted once built
        args.n_experts = None
        return False
    if not hf_model:
        args.n_experts = BUILT_IN_EXPERTS if args.n_experts is None else args.n_experts
        return False
    given = [f for f in GPT_MOE_FLAGS if getattr(args, f) != parser.get_default(f)]
    given = ["n_experts"] * (args.n_experts is not None) + given
    if given:
        raise UsageError(
            f"--{given[0]} shapes the built-in GPT's experts, but a 🤗 model (--model_name_or_path, "
            "--model_config) brings its own router and experts (its config: num_experts_per_tok, "
            "...): drop --" + given[0]
        )
    args.n_experts = 0  # the GPT's: none (common/builtin_flags.py refuses experts for a 🤗 model)
    return True


def check_ep_flags(args, world_size: int, hf_model: bool) -> int:
    """The degrees, before any process group exists. Returns ep. (A 🤗 model's experts are
    counted once it is built: check_experts.)"""
    ep = world_size if args.ep_size is None else args.ep_size
    if args.compile:
        raise UsageError(
            "--compile: train_ep.py does not compile its blocks yet (the all-to-all's splits "
            "depend on the routing, which breaks the graph at every MoE layer); drop --compile"
        )
    own_model = args.n_experts is None  # a model of one's own: check_experts counts its experts
    if not own_model and args.n_experts < 1 and not hf_model:  # no experts to cut: plain FSDP
        raise UsageError(
            f"--n_experts {args.n_experts}: expert parallelism cuts the experts of MoE layers, and "
            "this model has none; give it experts (--n_experts 8, the default), or train a dense "
            "model with train_fsdp.py"
        )
    if ep < 1:
        leave_out = f"leave it out: all {world_size} processes"
        raise UsageError(f"--ep_size must be at least 1 (got {ep}; {leave_out})")
    if world_size % ep:
        raise UsageError(
            f"--ep_size {ep} does not divide the {world_size} data-parallel processes: the experts "
            "are cut over groups of ep ranks that tile the processes; use an --ep_size that "
            f"divides {world_size}"
        )
    if not hf_model and not own_model and args.n_experts % ep:
        raise UsageError(
            f"--n_experts {args.n_experts} is not divisible by --ep_size {ep}: every EP rank holds "
            f"the same number of experts; use a multiple of {ep} experts or another --ep_size"
        )
    return ep


def check_experts(model, task, expert_modules: list, ep: int, dp: int) -> None:
    """Once the model is built, before it is cut: a 🤗 family's experts (common/hf_ep.py), a model
    of one's own with none that train_ep.py's experts_of finds, then the slices FSDP cuts each
    rank's experts into over the dp / ep groups."""
    if getattr(task, "hf_config", None) is not None:  # a 🤗 family's experts, named by its config
        from .hf_ep import check_hf_experts  # lazy: only a 🤗 model's run imports the 🤗 adapters

        check_hf_experts(model, task, expert_modules, ep)
    if not expert_modules:  # a model of one's own (or the GPT built without experts)
        raise UsageError(
            f"train_ep.py cuts the experts of MoE layers, and finds none in {type(model).__name__}: its "
            "experts_of finds the MoE layers of common/moe.py (MoE, as the built-in GPT's blocks hold) and "
            "those a 🤗 config names; give your model's blocks those MoE layers in the MODEL section "
            '(docs/ep.md, "A model of your own"), or train a model without experts with train_fsdp.py'
        )
    counts = sorted({experts.up_proj.shape[0] for experts in expert_modules if hasattr(experts, "up_proj")})
    if any(n % ep for n in counts):  # a model of one's own: its MoE layers' own counts
        raise UsageError(
            f"--ep_size {ep}: the MoE layers of {type(model).__name__} hold {', '.join(map(str, counts))} experts, "
            f"which {ep} does not divide: every EP rank holds the same number of experts; use an --ep_size that "
            "divides them, or layers with a multiple of it"
        )
    check_expert_slices(expert_modules, dp // ep)


def check_expert_slices(expert_modules: list, slices: int) -> None:
    """FSDP cuts each rank's experts along dim 1 (n_embd of up_proj, the hidden width of
    down_proj) into dp / ep equal slices."""
    widths = {p.shape[1] for experts in expert_modules for p in experts.parameters()}
    if any(width % slices for width in widths):
        raise UsageError(
            f"--ep_size: the experts are cut again over the {slices} groups of ep ranks (dp / ep), "
            f"along their widths {sorted(widths)}, which {slices} does not divide; use a larger "
            f"--ep_size (fewer groups) or widths that {slices} divides"
        )
