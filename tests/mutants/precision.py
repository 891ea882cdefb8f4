"""16-bit precision: apex's O2 written out (manual_train/loops/apex_o2.py's marked lines, manual_train/apex_o2.py's
DynamicLossScaler) and torch.amp's GradScaler as the loops use it (manual_train/loops/single.py)."""
from mutants import Mutant

INVARIANTS = "tests/test_apex_o2.py::test_o2_invariants_hold_at_every_step_of_the_loop"  # 5 steps, every step checked
NATIVE = "tests/test_apex_o2.py::test_o2_equals_native_fp16_autocast_without_batchnorm"  # 40 steps vs 16-mixed
CLIPPED = "tests/test_apex_o2.py::test_o2_equals_native_fp16_autocast_with_gradient_clipping"  # the same, clipped
INF_O2 = "tests/test_precision.py::test_injected_inf_skips_the_step_and_the_scheduler[16-o2-for-loop]"
INF_AMP = "tests/test_precision.py::test_injected_inf_skips_the_step_and_the_scheduler[16-mixed-for-loop]"
# The demos: the MLP on digits for 4 or 5 epochs, where the correct run learns (val acc >= 0.95)
DEMO_O2 = ("apex_o2", 0, "--model", "mlp", "--epochs", "4")
DEMO_O2_CLIP = DEMO_O2 + ("--grad-clip", "1.0")
DEMO_AMP_CLIP = ("single", 0, "--precision", "16-mixed", "--model", "mlp", "--epochs", "4", "--grad-clip", "1.0")
# the scale grows (and overflows) within the run
DEMO_O2_GROWTH = ("apex_o2", 0, "--model", "mlp", "--epochs", "5", "--loss-scale-growth-interval", "5")
# the first steps overflow (a scale of 1e9) and are skipped; for-loop kernels (fused SGD's own skip is another matter)
DEMO_AMP_SKIPS = ("single", 0, "--precision", "16-mixed", "--model", "mlp", "--epochs", "4", "--loss-scale-init",
                  "1e9", "--optimizer-impl", "for-loop")

MUTANTS = [
    Mutant(
        name="precision-o2-masters-not-copied-back",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="                        for p, master in zip(model_params, master_params):\n"
            "                            p.copy_(master)",
        new="                        pass  # the optimizer stepped the masters; the fp16 model is left as it was",
        says="The fp32 masters stepped but never copied back into the fp16 model: every forward runs the initial "
             "weights, while the checkpoint (the masters) moves.",
        kill=(INVARIANTS,), demo=DEMO_O2),
    Mutant(
        name="precision-o2-loss-not-scaled",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="                (loss * scaler.scale).backward()",
        new="                loss.backward()",
        says="The loss scale left out of backward but still divided out of the gradients: every gradient is "
             "2**16 times too small (and the small ones underflow in fp16).",
        kill=(NATIVE,), demo=DEMO_O2),
    Mutant(
        name="precision-o2-gradients-not-unscaled",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="p.grad.float().mul_(1.0 / scaler.scale)",
        new="p.grad.float()",
        says="The scaled fp16 gradients copied into the masters without dividing by the loss scale: the optimizer "
             "steps 2**16 times the gradient.",
        kill=(NATIVE,), demo=DEMO_O2),
    Mutant(
        name="precision-o2-clips-the-fp16-model",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer) if amp else "
            "master_params,",
        new="                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(),",
        says="clip_grad_norm_(model.parameters()) under O2, as in fp32 code: the gradients live on the fp32 masters "
             "by then, so nothing is clipped (apex: clip amp.master_params(optimizer)).",
        kill=(CLIPPED,), demo=DEMO_O2_CLIP),
    Mutant(
        name="precision-o2-overflow-steps-anyway",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="                if not found_inf:\n",
        new="                if True:  # the scaler halves the scale; the step is taken anyway\n",
        says="The inf/NaN check computed but the step taken anyway: one overflow writes inf/NaN into the fp32 "
             "masters, and the run is lost.",
        kill=(INF_O2,), demo=DEMO_O2_GROWTH),
    Mutant(
        name="precision-o2-scale-never-backs-off",
        technique="precision",
        file="manual_train/loops/apex_o2.py",
        old="                scaler.update(found_inf)",
        new="                scaler.update(False)",
        says="The scaler told every step was clean: after an overflow the scale stays where it overflowed (and keeps "
             "growing), so every later step can overflow and be skipped.",
        kill=(INF_O2,), demo=DEMO_O2_GROWTH),
    Mutant(
        name="precision-o2-scaler-growth-uncapped",
        technique="precision",
        file="manual_train/apex_o2.py",
        old="            self.scale = min(self.scale * self.growth_factor, self.max_scale)",
        new="            self.scale *= self.growth_factor",
        says="The dynamic loss scale doubled without apex's cap (2**24): after long clean stretches it grows until "
             "fp16 overflows and steps are skipped to bring it back.",
        kill=("tests/test_apex_o2.py::test_growth_after_the_interval_and_the_cap",), demo=DEMO_O2_GROWTH),
    Mutant(
        name="precision-amp-clip-before-unscale",
        technique="precision",
        file="manual_train/loops/single.py",
        old="                scaler.unscale_(optimizer)  # true gradients before clipping",
        new="                pass  # scaler.step unscales; clipping first",
        says="Clipping without scaler.unscale_ first: the norm of the scaled gradients (2**16 too large) is clipped, "
             "then scaler.step unscales, so every clipped step is 2**16 times too short.",
        kill=(CLIPPED,), demo=DEMO_AMP_CLIP),
    Mutant(
        name="precision-amp-schedule-steps-on-skip",
        technique="precision",
        file="manual_train/loops/single.py",
        old="                if run.stepped(scaler, losses):  # a skipped step does not advance the schedule",
        new="                if True:  # a skipped step does not advance the schedule",
        says="scheduler.step() after every window, also when GradScaler skipped optimizer.step() on an overflow: "
             "the schedule runs ahead of the weights (torch warns 'lr_scheduler.step() before optimizer.step()').",
        report="pytorch/pytorch#44511",
        kill=(INF_AMP,), demo=DEMO_AMP_SKIPS),
]
