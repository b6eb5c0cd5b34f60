"""How much of common/ a script carries: run it for real, then count the lines of every common.* module
it imported.

    python tests/ground_floor.py scripts/train_ddp.py --model_size tiny --max_steps 1 --output_dir /tmp/x

runs the script in this interpreter as `python scripts/train_ddp.py ...` would (runpy, as __main__, with
that argv), and prints one JSON object as its last line: {"lines": N, "modules": {"common.data": lines,
...}}: the `wc -l` of each common.* module in sys.modules at the end of the run, and of each sibling
script it imported (a lesson used as a library) (tests/test_ground_floor.py). Under a launcher (several
processes: `accelerate launch ... tests/ground_floor.py scripts/train_ddp.py ...`) every rank runs the
script and rank 0 prints its count.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path

LESSON_FILES = re.compile(r"(train_\w+|plan_layout|evaluate)\.py")


def common_modules(script: Path) -> dict[str, int]:
    """{module name: its lines} for each project module this interpreter has imported: the `common`
    package, and any sibling script of `script` (a lesson imported as a library), not `script` itself."""
    counted = {}
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or Path(path).resolve() == script:  # the script itself (__main__, __mp_main__)
            continue
        sibling = Path(path).resolve().parent == script.parent and LESSON_FILES.fullmatch(Path(path).name)
        if name == "common" or name.startswith("common.") or sibling:
            counted[name] = len(Path(path).read_text(encoding="utf-8").splitlines())
    return counted


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    modules = common_modules(Path(script).resolve())
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"returncode": code, "lines": sum(modules.values()), "modules": modules}), flush=True)


if __name__ == "__main__":
    main()
