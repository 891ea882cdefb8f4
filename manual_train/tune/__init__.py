"""python -m manual_train.tune: the fastest way to launch your training on this machine, measured (docs/tuner.md).

    python -m manual_train.tune --model cnn --dataset digits                      # exact levers, 180 s
    python -m manual_train.tune --model cnn --budget-s 60 --out runs/tune --batch-size 64
    python -m manual_train.tune --model mlp --allow-changes                       # also batch size, bf16

Runs short real trainings of candidate commands side by side (A B C A B C), timed by their steady wall time per
sample, and prints the fastest as one ready command. Exact levers train the same model as the reference (python
launch/single.py with your flags): processes vs threads (torchrun launch/ddp.py with the global batch kept), DataLoader
workers and prefetch, pinned memory (GPU), --optimizer-impl, DDP's exact knobs, --eval-mode, --compile. Levers that
change the optimisation (a larger batch with --lr-scaling, bf16-mixed where the hardware has fast bf16) are tried
only with --allow-changes. A lever is kept only when it beats the current best by more than the trials' noise.
Training flags (those of launch/single.py) go anywhere on the line and stay in the command; a lever whose flag you
set is not tuned. Results: DIR/tune.json (--out).
"""
