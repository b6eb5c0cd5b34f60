"""Every guard a copy carries is started by its own line(s) of the script, marked `# guard: <name>`, and a
learner may delete them and still train (issue 56): a copy of train_ddp.py for a model of one's own
(docs/your-model.md's regression, as tests/test_ground_floor.py builds it, outside the repository), once
as it is and once without each guard's marked lines, trains 2 steps on 2 processes, saves a checkpoint and
exports its model, exit 0. Every lesson marks the same guards as train_ddp.py.

    peer records    record_peers(accelerator): who every rank is, for the line of a lost peer
    output lock     check_resume_and_output(...): the --output_dir lock, the checks of a resume
    cut check       two lines: uncut_copy(...) before the cut, check_cut(...) after it
    contract        check_task_contract(...): the Task's methods, the evaluation's cut, a trial export
    trial           trial_checkpoint(...): the run's own save, read back, before step 1 (a run that saves)
"""

import json

import pytest
from test_ground_floor import own_model_copy

from conftest import REPO, SCRIPTS, run_in_turn

GUARDS = {  # the marker's name: how many lines it marks
    "peer records": 1,
    "output lock": 1,
    "cut check": 2,
    "contract": 1,
    "trial": 1,
}
LESSONS = sorted(p.name for p in SCRIPTS.glob("train_*.py"))
FLAGS = ["--max_steps", "2", "--warmup_steps", "1", "--eval_every", "0", "--checkpoint_every", "2"]


def marked(text: str, guard: str) -> list[str]:
    return [line for line in text.splitlines() if f"  # guard: {guard}" in line]


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_marks_the_same_guards(lesson):
    text = (SCRIPTS / lesson).read_text()
    counted = {guard: len(marked(text, guard)) for guard in GUARDS}
    assert counted == GUARDS, f"{lesson}: guard lines {counted}, expected {GUARDS}"
    every = [line for line in text.splitlines() if "# guard: " in line]
    assert len(every) == sum(GUARDS.values()), f"{lesson}: a guard line of no known guard: {every}"


def test_a_copy_trains_with_any_guard_deleted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards")
    assert REPO not in folder.resolve().parents
    copy = own_model_copy(folder / "copy")
    text = copy.read_text()
    scripts = {"unedited": copy}
    for guard in GUARDS:
        lines = marked(text, guard)
        assert len(lines) == GUARDS[guard], f"the copy's {guard} lines: {lines}"
        without = copy.with_name(f"train_ddp_without_{guard.replace(' ', '_')}.py")
        without.write_text("".join(line for line in text.splitlines(keepends=True) if line.rstrip("\n") not in lines))
        scripts[guard] = without
    outs = {name: folder / "runs" / name.replace(" ", "_") for name in scripts}
    cases = [[str(script), [*FLAGS, "--output_dir", str(outs[name])]] for name, script in scripts.items()]
    results = dict(zip(scripts, run_in_turn(cases, 2, folder / "in_turn"), strict=True))
    for name, result in results.items():
        said = f"{name}: exit {result['returncode']}\n{result['stdout'][-2000:]}\n{result['stderr'][-3000:]}"
        assert result["returncode"] == 0, said
        records = [json.loads(line) for line in (outs[name] / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["type"] == "train"][-1] == 2, said
        assert records[-1]["type"] == "summary" and records[-1]["final_step"] == 2, said
        assert (outs[name] / "model").is_dir() and (outs[name] / "checkpoints" / "step_2").is_dir(), said
        assert not (outs[name] / ".run.lock").exists(), f"{name}: the lock outlived the run"
    assert "cut checked: " in results["unedited"]["stdout"], results["unedited"]["stdout"][-2000:]
    assert "cut checked: " not in results["cut check"]["stdout"]
