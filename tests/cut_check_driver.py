"""Runs a training script with one of its named gates turned off, to show that the start-up cut check
(scripts/common/cut_check.py) refuses the wrong run without them (tests/test_cut_check.py):

    accelerate launch ... tests/cut_check_driver.py GATE scripts/train_X.py ARGS...

GATE: `window`, the ring and Ulysses are handed no layer's sliding window (as before the window gate
existed); `ties`, a 🤗 model keeps its tied embeddings and TP's two tie refusals are off; `crash`, rank 1
raises a ValueError of its own at step 2 (tests/test_faults.py); `mean`, the built-in models' loss is
returned as a mean; `killed`, rank 1 is SIGKILLed as evaluation starts (evaluate.py); `none`."""

import os
import runpy
import sys
from pathlib import Path

gate, script, *args = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))
import common.hf
import common.tied

if gate == "window":
    set_attention = common.hf.HFCausalLMTask.set_attention

    def windowless(self, model, attention):
        def without_window(q, k, v, window=None, **masks):
            return attention(q, k, v, **masks)

        return set_attention(self, model, attention and without_window)

    common.hf.HFCausalLMTask.set_attention = windowless
elif gate == "ties":
    from transformers import AutoModelForCausalLM

    from_config = AutoModelForCausalLM.from_config

    def tied(config, **kwargs):
        config.tie_word_embeddings = True
        return from_config(config, **kwargs)

    AutoModelForCausalLM.from_config = tied
    common.hf.check_untied = lambda *a, **k: None
    common.tied.check_tp_keeps_ties = lambda *a, **k: None
elif gate == "crash":
    import common.training

    next_step = common.training.StepFeed.next_step

    def crashing(self):
        if self.step == 1 and os.environ.get("RANK") == "1":
            raise ValueError("a bug of rank 1's own, at step 2")
        return next_step(self)

    common.training.StepFeed.next_step = crashing
elif gate == "killed":  # rank 1 is SIGKILLed as evaluation starts (evaluate.py; tests/test_faults.py)
    import signal
    import time

    import common.evaluation

    evaluate = common.evaluation.evaluate

    def killed(*args, **kwargs):
        if os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # rank 0 in no collective (gloo would see the loss first): the launcher's SIGTERM comes
        return evaluate(*args, **kwargs)

    common.evaluation.evaluate = killed
elif gate == "mean":  # the built-in models' loss returned as a mean (what check_task_contract refuses)
    import common.causal_lm

    loss = common.causal_lm.CausalLMTask.loss

    def mean(self, outputs, targets):
        loss_sum, n_targets = loss(self, outputs, targets)
        return loss_sum / n_targets, n_targets

    common.causal_lm.CausalLMTask.loss = mean
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
