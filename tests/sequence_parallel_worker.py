"""Run by tests/test_sequence_parallel.py under ``torch.distributed.run --nproc_per_node N`` (gloo, N = 2 or 4).

Every rank builds the same tiny Llama (4 query heads, 2 key/value heads: with N = 4 they are repeated) and batch, and
computes one process's chosen and rejected log-probs, DPO loss and gradients with ``BasicTrainer.concatenated_forward``
on the whole rows; then the sequence-parallel group computes them from its slices (rows whose length N does not
divide). Log-probs, the loss (OpenRLHF #564: N ranks' loss is one rank's, not N times it) and every gradient (summed
over the group) must equal one process's to 1e-5, packed or padded, chunked output layer or not, the reference
too, and SFT's single sequences. With N = 4, also 2-D: FSDP over all 4 ranks, 2 data-parallel groups x 2 sequence-parallel ranks. Each case
prints ``rank R: CASE ok``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trainers  # noqa: E402
from parallel import process_group  # noqa: E402
from parallel import sequence_parallel as sp  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
BETA = 0.1


def tiny_llama(seed: int):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).float()


def make_batch(prompts: list[int], chosen: list[int], rejected: list[int], seed: int = 1) -> dict:
    """B pairs, right-padded: prompt of ``prompts[i]`` tokens, then chosen / rejected responses of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side, lengths in (("chosen", chosen), ("rejected", rejected)):
        width = max(p + n for p, n in zip(prompts, lengths))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            prompt = torch.randint(1, 64, (p,), generator=torch.Generator().manual_seed(100 + i))  # shared by the pair
            ids[i, :p], ids[i, p : p + n] = prompt, torch.randint(1, 64, (n,), generator=g)
            mask[i, : p + n], labels[i, p : p + n] = 1, ids[i, p : p + n]
        batch |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    batch["prompt"] = ["x"] * len(prompts)
    return batch


def one_process(model, batch, packed, chunk, average=False):
    stand_in = SimpleNamespace(
        packed=packed, average_log_prob=average, device=torch.device("cpu"), max_forward_chunks=None,
        output_layer_chunk=chunk, token_weight=None,
    )  # fmt: skip
    return trainers.BasicTrainer.concatenated_forward(stand_in, model, batch)


def dpo_loss(pc, pr, rc, rr, n_total):
    return -F.logsigmoid(BETA * ((pc - rc) - (pr - rr))).sum() / n_total


def check_case(name, rank, group, policy, reference, batch, packed, chunk, average=False):
    single, sp_policy = copy.deepcopy(policy), copy.deepcopy(policy)
    sp_reference = copy.deepcopy(reference)
    sp.use_sequence_parallel_attention(sp_policy)
    sp.use_sequence_parallel_attention(sp_reference)
    n = batch["chosen_input_ids"].shape[0]
    pc, pr, n_tokens = one_process(single, batch, packed, chunk, average)
    with torch.no_grad():
        rc, rr, _ = one_process(reference, batch, packed, chunk, average)
    loss = dpo_loss(pc, pr, rc, rr, n)
    loss.backward()

    kwargs = dict(packed=packed, average_log_prob=average, chunk=chunk)
    logps, sp_tokens = sp.sequence_parallel_logps(sp_policy, batch, group, torch.device("cpu"), **kwargs)
    with torch.no_grad():
        ref, _ = sp.sequence_parallel_logps(sp_reference, batch, group, torch.device("cpu"), **kwargs)
    torch.testing.assert_close(logps[:n], pc, **TOL, msg=f"{name} chosen")
    torch.testing.assert_close(logps[n:], pr, **TOL, msg=f"{name} rejected")
    torch.testing.assert_close(ref, torch.cat([rc, rr]), **TOL, msg=f"{name} reference")
    torch.testing.assert_close(sp_tokens, n_tokens, rtol=0, atol=0, msg=f"{name} n_tokens")
    sp_loss = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], n)
    # OpenRLHF #564: each rank's loss is the one-process loss, not N times it nor 1/N of it
    torch.testing.assert_close(sp_loss, loss, **TOL, msg=f"{name} loss")
    sp_loss.backward()
    for (key, p), q in zip(single.named_parameters(), sp_policy.parameters()):
        grad = q.grad.clone()
        torch.distributed.all_reduce(grad, group=group)  # each rank holds its positions' share
        torch.testing.assert_close(grad, p.grad, **TOL, msg=f"{name} grad {key}")
    print(f"rank {rank}: {name} ok", flush=True)


def check_sft(rank, group, policy, batch, chunk):
    """SFT's single sequences (the chosen rows alone): log-probs, the loss and every gradient as one process's."""
    from modeling import forward

    single, sp_policy = copy.deepcopy(policy), copy.deepcopy(policy)
    sp.use_sequence_parallel_attention(sp_policy)
    rows = {k: batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")}
    n = rows["input_ids"].shape[0]
    logps, n_tokens = forward.single_logps(single, rows, False, torch.device("cpu"), None, chunk)
    (-logps.sum() / n_tokens.sum()).backward()
    sp_logps, sp_tokens = sp.sequence_parallel_logps(sp_policy, rows, group, torch.device("cpu"), chunk=chunk)
    assert sp_logps.shape == (n,), sp_logps.shape
    torch.testing.assert_close(sp_logps, logps, **TOL, msg="sft logps")
    torch.testing.assert_close(sp_tokens, n_tokens, rtol=0, atol=0, msg="sft n_tokens")
    (-sp_logps.sum() / sp_tokens.sum()).backward()
    for (key, p), q in zip(single.named_parameters(), sp_policy.parameters()):
        grad = q.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, p.grad, **TOL, msg=f"sft grad {key}")
    print(f"rank {rank}: sft ok", flush=True)


def check_fsdp_by_sp(rank, world, policy, reference, batch, chunk):
    """FSDP over every rank, 2 data-parallel groups (each half of the batch) x 2 sequence-parallel ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parallel.dist import split_batch

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "sp"))
    whole = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    single = copy.deepcopy(policy)
    n = batch["chosen_input_ids"].shape[0]
    pc, pr, _ = one_process(single, batch, True, chunk)
    with torch.no_grad():
        rc, rr, _ = one_process(reference, batch, True, chunk)
    dpo_loss(pc, pr, rc, rr, n).backward()

    sharded, sp_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    for model in (sharded, sp_reference):
        sp.use_sequence_parallel_attention(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=whole)
        fully_shard(model, mesh=whole)
    part = split_batch(batch, world // 2)[mesh["dp"].get_local_rank()]
    group = mesh["sp"].get_group()
    logps, _ = sp.sequence_parallel_logps(sharded, part, group, torch.device("cpu"), chunk=chunk)
    with torch.no_grad():
        ref, _ = sp.sequence_parallel_logps(sp_reference, part, group, torch.device("cpu"), chunk=chunk)
    m = part["chosen_input_ids"].shape[0]
    loss = dpo_loss(logps[:m], logps[m:], ref[:m], ref[m:], n)  # this group's share of the whole batch's loss
    (loss * world).backward()  # FSDP averages over all ranks; the groups' and the positions' shares add up
    for (key, p), q in zip(single.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, **TOL, msg=f"fsdp x sp grad {key}")
    print(f"rank {rank}: fsdp x sp ok", flush=True)


def main() -> None:
    rank = process_group.init_distributed()
    world = torch.distributed.get_world_size()
    group = torch.distributed.new_group(list(range(world)))
    policy, reference = tiny_llama(0), tiny_llama(1)
    # rows of 5 + 8 = 13 and 7 + 6 = 13 tokens (packed: 5 + 8 + 5 = 18, 7 + 6 + 3 = 16): not divisible by 2 or 4
    batch = make_batch(prompts=[5, 7], chosen=[8, 6], rejected=[5, 3])
    check_case("packed", rank, group, policy, reference, batch, packed=True, chunk=None)
    check_case("packed chunked", rank, group, policy, reference, batch, packed=True, chunk=3)
    check_case("padded", rank, group, policy, reference, batch, packed=False, chunk=None)
    check_case("padded chunked averaged", rank, group, policy, reference, batch, packed=False, chunk=4, average=True)
    long_prompt = make_batch(prompts=[17], chosen=[3], rejected=[2], seed=2)  # rank 0 holds prompt positions only
    check_case("targets on some ranks only", rank, group, policy, reference, long_prompt, packed=True, chunk=2)
    check_sft(rank, group, policy, batch, chunk=3)  # SFT targets of 13 and 13 tokens (5 + 8, 7 + 6)
    if world == 4:
        four = make_batch(prompts=[5, 7, 3, 9], chosen=[8, 6, 4, 2], rejected=[5, 3, 6, 1], seed=3)
        check_fsdp_by_sp(rank, world, policy, reference, four, chunk=3)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
