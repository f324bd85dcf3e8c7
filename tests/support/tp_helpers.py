"""Process bodies for test_tp.py (spawned processes import them by module name)."""

import json
import os


def disagree(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from compile_pass.examples.tp_decode import check_options_agree

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check_options_agree({"max_context_len": 128 if rank == 0 else 256, "cudagraphs": False})
        error = None
    except ValueError as e:
        error = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error}, f)
