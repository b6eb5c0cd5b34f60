"""train_pp.py with a model of one's own (issue 56, item 6): a copy for a model with a Vision Transformer's
shape (tests/vit_shaped.py: fused qkv, class token, blocks in an nn.Sequential, drop path), outside the
repository, its data and MODEL sections replaced as a learner replaces them, run on 2 processes.

(a) Its pipeline stages not yet written (the MODEL section's stage_modules knows only the built-in GPT and
    🤗 models): refused in one `error:` line that names stage_modules and docs/pp.md, no traceback.
(b) Stages written, but the Task names the blocks one by one (units_path a list of names, a view of the
    model's blocks): the split drops the other rank's blocks from the view only, so they stay in the model.
    Refused before step 1 in one line naming the first such parameter, also under --skip_cut_check (the
    run would train them nowhere, and its export would write their untrained copy).
(c) Stages written for the ViT's shape (below, as a learner writes them): 2 processes match 1 within 1e-5."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from conftest import CPU_MULTI, REPO, SCRIPTS, assert_same_losses, free_port, job_env, run_cmd, train_losses

sys.path.insert(0, str(SCRIPTS))  # vit_shaped.py imports common.task, as it does beside a copy
from vit_shaped import DATA, MODEL

VIT_SHAPED = Path(__file__).with_name("vit_shaped.py")
DATA_MARKER = "    # ---------------------------------------- data"
STAGES_MARKER = "# ======================================== MODEL: how one pipeline stage runs"
STRATEGY_MARKER = "# ======================================== PP: the strategy"
BUILTIN_FLAGS = r"^    from common\.builtin_flags import add_builtin_flags.*\n\n    add_builtin_flags\(.*\n"
FLAGS = ["--max_steps", "4", "--batch_size", "16", "--log_every", "1", "--eval_every", "0", "--warmup_steps", "1"]

# the MODEL section's stage builder for the ViT's shape, as a learner writes it (docs/pp.md, "A model of your own")
VIT_STAGES = '''\
# ======================================== MODEL: how one pipeline stage runs (docs/pp.md)
class ViTStage(nn.Module):
    """Some of the ViT's blocks; the first stage embeds the patches and adds the class token and the
    positions, the last applies the final norm and the head to the class token."""

    def __init__(self, model, units: range, is_first: bool, is_last: bool):
        super().__init__()
        self.patch, self.is_first = model.patch, is_first
        if is_first:  # the model's own modules and parameters: their names in the model do not change
            self.patch_embed, self.cls_token, self.pos_embed = model.patch_embed, model.cls_token, model.pos_embed
        self.blocks = nn.ModuleList(model.blocks[i] for i in units)
        self.norm, self.head = (model.norm, model.head) if is_last else (None, None)

    def forward(self, x):
        if self.is_first:
            x = self.patch_embed(x.view(x.shape[0], -1, self.patch))
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])) if self.head is not None else x


def stage_modules(model, stages):
    if not any(first for _, first, _ in stages):
        model.patch_embed = model.cls_token = model.pos_embed = None
    if not any(last for _, _, last in stages):
        model.norm = model.head = None
    return [ViTStage(model, units, first, last) for units, first, last in stages]


'''
# the MODEL section with the blocks named one by one: a list of the model's blocks, not their container
BLOCK_BY_BLOCK = """\
    from vit_shaped import ViTShaped, ViTTask  # your model and its Task, beside this copy

    class BlockByBlockTask(ViTTask):
        units_path = ["blocks.0", "blocks.1"]

    model, task = ViTShaped(), BlockByBlockTask()
"""


def pp_copy(folder: Path, model_section: str = MODEL, stages: str | None = None) -> Path:
    """train_pp.py and common/ copied side by side outside the repository, vit_shaped.py beside them; the
    copy's data section and its main()'s MODEL lines replaced (as tests/test_ground_floor.py's
    own_model_copy does), the built-in flags dropped, and the stage builder replaced by `stages` if given."""
    assert REPO not in folder.resolve().parents
    folder.mkdir(parents=True)
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(VIT_SHAPED, folder / "vit_shaped.py")
    lines = (SCRIPTS / "train_pp.py").read_text().splitlines(keepends=True)
    data = next(i for i, line in enumerate(lines) if line.startswith(DATA_MARKER))
    loader = next(i for i in range(data, len(lines)) if "train_loader = make_train_loader(" in lines[i])
    seed = next(i for i in range(loader, len(lines)) if lines[i].strip().startswith("set_seed(args.seed)"))
    to_device = next(i for i in range(seed, len(lines)) if "model = model.to(accelerator.device)" in lines[i])
    text = "".join([*lines[: data + 1], DATA, *lines[loader : seed + 1], model_section, *lines[to_device:]])
    text, n = re.subn(BUILTIN_FLAGS, "", text, flags=re.M)
    assert n == 1, "train_pp.py's flags section: no add_builtin_flags lines to drop"
    if stages is not None:
        start, end = text.index(STAGES_MARKER), text.index(STRATEGY_MARKER)
        text = text[:start] + stages + text[end:]
    (folder / "train_pp.py").write_text(text)
    return folder


def run_copy(folder: Path, nproc: int, *flags: str):
    """`python train_pp.py` for 1 process, `accelerate launch` with cpu_multi.yaml for 2, in the copy's folder."""
    args = ["train_pp.py", *FLAGS, "--output_dir", str(folder / "run"), *flags]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    ports = ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = [sys.executable, *args] if nproc == 1 else [*launcher, *ports, *args]
    return run_cmd(cmd, env=job_env(), cwd=folder)


def refusal(result, folder: Path) -> str:
    """The one `error:` line of a run refused before step 1, with no traceback through the copy's files
    (the launcher's own ChildFailedError report follows a failed worker: its frames are torch's)."""
    assert result.returncode != 0, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-5000:]
    frames = [line for line in result.stderr.splitlines() if re.match(rf'\s*File "{re.escape(str(folder))}', line)]
    assert not frames, "a traceback through the copy's files:\n" + result.stderr[-5000:]
    assert not (folder / "run" / "model").exists(), "a refused run exported a model"
    return errors[0]


def test_stages_not_written_are_refused_in_one_line(tmp_path):
    folder = pp_copy(tmp_path / "copy")
    line = refusal(run_copy(folder, 2), folder)
    assert "no pipeline stages for ViTShaped yet" in line, line
    assert "MODEL section" in line and "stage_modules" in line and "docs/pp.md" in line, line


def test_other_stages_blocks_left_in_the_model_are_refused_naming_the_first(tmp_path):
    folder = pp_copy(tmp_path / "copy", BLOCK_BY_BLOCK, VIT_STAGES)
    line = refusal(run_copy(folder, 2, "--skip_cut_check"), folder)
    # rank 0 holds blocks.0: blocks.1, the other rank's, is still in its model (its first parameter named)
    assert "blocks.1.norm1.weight, a parameter of unit 1 (another rank's pipeline stage)" in line, line
    assert "still in this rank's model" in line and "stage_modules" in line and "Task.units_path" in line, line


def test_stages_written_for_the_vit_match_one_process(tmp_path):
    """The ViT's blocks in their nn.Sequential (units_path "blocks"), one per rank; drop path and dropout 0."""
    one, two = pp_copy(tmp_path / "one", stages=VIT_STAGES), pp_copy(tmp_path / "two", stages=VIT_STAGES)
    for folder, nproc in ((one, 1), (two, 2)):
        result = run_copy(folder, nproc)
        assert result.returncode == 0, f"{nproc} process(es):\n{result.stderr[-5000:]}"
    assert "cut checked" in result.stdout + result.stderr  # the 2-process run's stages are the model
    assert_same_losses(train_losses(one / "run"), train_losses(two / "run"), range(1, 5), tol=1e-5)
    assert (two / "run" / "model").is_dir()
