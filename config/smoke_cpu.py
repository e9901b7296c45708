# A two-minute run on a laptop-class CPU (2 cores): a tiny looped model on the builtin corpus (Python's own
# documentation in GPT-2 tokens, prepared offline on first use). Val loss starts at ln(50304) ~ 10.8 and ends far
# below it; the point is to see every part of train.py work, not to get a good model.
#   python train.py config/smoke_cpu.py
#   python train.py config/smoke_cpu.py --init_from=resume --max_iters=200    # carry on from out-smoke/ckpt.pt
# Nearly all the compute goes to the 50304-wide output layer, so the width stays small and the steps short.
out_dir = "out-smoke"
dataset = "builtin"
device = "cpu"
dtype = "float32"
compile = False  # compiling would take longer than the whole run

n_layer = 2
n_loop = 2  # unrolled depth 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 8
gradient_accumulation_steps = 1  # 1,024 tokens per step

learning_rate = 2e-3  # a tiny model takes a large learning rate
max_iters = 150
lr_decay_iters = 150
warmup_iters = 20
min_lr = 2e-4

eval_interval = 50
eval_iters = 10
log_interval = 10
