"""Applications over the library: the `vocagno` command, the demo, evaluation and analysis.
They import `pipeline` and start the stages only through their entry points (`stage1_score/run.py`
as a Ray job, `stage2_train/train.py` under torchrun), never by importing them."""
