"""Property probes: checks of what every correct training step has, run on a plain ``nn.Module`` and
a batch, on one process (no collective, no Lightning, no Hydra). The preflight doctor
(``dsdebug.doctor``) runs them all before a run; the ``preflight`` check runs the cheap ones on the
run's first real batch (``debug=light``), and ``outcome_monitor`` runs one on the spot when the loss
says it should.

| probe | module | breaks when |
|---|---|---|
| loss at initialisation vs ln(vocab) | ``init_loss`` | output scale wrong at init; the model sees its targets |
| causality (net and labels) | ``causality`` | position t depends on inputs after t; labels not shifted |
| sample independence | ``sample_independence`` | one sample's output depends on another sample |
| train/eval consistency | ``train_eval`` | eval path computes something else than train (dropout off) |
| the run's plan | ``plan`` | LR schedule never peaks, clipping shrinks every update, tiny dataset |

``registry.PROBES`` is what the three harnesses (the doctor, ``preflight``, ``outcome_monitor``) read;
``on_the_run`` runs a probe the one way they share (guarded, agreed across ranks, traced on a failure).
``tracing`` records every module's output so a probe names the first module where a property breaks;
``result.ProbeResult`` is what each returns (status, culprit, advice).
"""

__all__: list[str] = []
