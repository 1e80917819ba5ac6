"""Run by tests/test_distributed.py under ``torch.distributed.run --nproc_per_node 2`` (gloo).

For each model family and way of sharding (FSDP, tensor parallel): rank 0 builds the model
(``models.rank0_model``; the other rank's ``build`` would fail), every other rank gets it on the
meta device, ``shard_from_rank0`` shards it and sends the weights; the sharded model's logits
must equal those of the whole model (built on every rank from the same seed, for comparison),
tied embeddings must stay one parameter, and the rotary buffers must be rank 0's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trainers  # noqa: E402
from modeling import models
from parallel import fsdp, process_group, tensor_parallel

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=True,
    ),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64),
}


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    rank = process_group.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    trainer = SimpleNamespace(dist=SimpleNamespace(rank=rank), device=torch.device("cpu"))
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    for family, config in CONFIGS.items():
        for how in ("fsdp", "tp"):
            torch.manual_seed(0)
            whole = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(vocab_size=100, **config))
            whole.eval()

            def build(whole=whole):
                assert rank == 0, "only rank 0 may load the weights"
                return copy.deepcopy(whole)

            model = models.rank0_model(build, rank)
            assert all(p.is_meta for p in model.parameters()) == (rank != 0), (family, how, rank)
            if how == "fsdp":
                blocks = fsdp.find_block_classes(model, None)
                trainers._DistributedTrainer.shard_from_rank0(
                    trainer, model, lambda m, blocks=blocks: fsdp.fully_shard_blocks(m, blocks, mesh=mesh)
                )
            else:
                plan = tensor_parallel.tensor_parallel_plan(model, 2)
                trainers._DistributedTrainer.shard_from_rank0(
                    trainer, model, lambda m, plan=plan: parallelize_module(m, mesh, plan)
                )
            model.eval()
            with torch.no_grad():
                torch.testing.assert_close(
                    model(tokens).logits, whole(tokens).logits, rtol=1e-5, atol=1e-5, msg=f"{family} {how}"
                )
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            assert tied == bool(model.config.tie_word_embeddings), (family, how, "tie")
            for name, buffer in whole.named_buffers():
                if "inv_freq" in name:
                    torch.testing.assert_close(model.get_buffer(name), buffer, msg=name)
            print(f"rank {rank}: {family} {how} ok", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    # leave without the interpreter's teardown, as training ranks do (processes.exit_rank): freeing
    # gloo's last collective during teardown sometimes aborts a rank that has finished its work
    from runs import processes

    processes.exit_rank(main)
