# the race's changes to config/train_gpt2.py (bench/speedrun.py writes this file)
block_size = 1024
max_iters = 300
lr_decay_iters = 300
warmup_iters = 11
eval_interval = 25
eval_iters = 43
log_interval = 1
always_save_checkpoint = True
wandb_log = False
out_dir = '/tmp/ing/speedrun/nanogpt'
dataset = '/tmp/ing/speedrun/nanogpt_data'
import atexit as _atexit, resource as _resource
def _peak():
    gb = (torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else
          _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1e6)
    print(f'speedrun: peak memory {gb:.4f} GB', flush=True)
_atexit.register(_peak)
