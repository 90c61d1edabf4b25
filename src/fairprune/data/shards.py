"""Evaluation data under ``torch.distributed``: each process a disjoint shard, nothing repeated.

Lightning gives a validation or test loader a padded ``DistributedSampler`` under DDP: the split
is rounded up to a multiple of the number of processes by repeating samples (39 images on two
processes are measured as 40), so per-group counts and accuracies differ from one process's.
:class:`ShardSampler` is an unpadded one (process ``r`` of ``w`` takes indices ``r, r + w, ...``);
being a ``DistributedSampler``, Lightning leaves it in place, and metric states summed across
processes then cover every sample exactly once.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from fairprune.distributed import world


class ShardSampler(DistributedSampler):
    """This process's share of ``size`` samples, in order, without padding: ``rank::num_replicas``.

    Shards differ in length by at most one sample (so the processes may run a different number of
    batches: nothing may synchronise per batch; epoch-end metric syncs are fine).
    """

    def __init__(self, size: int, rank: int | None = None, num_replicas: int | None = None) -> None:
        found_rank, found_world = world()
        super().__init__(range(size), num_replicas=found_world if num_replicas is None else num_replicas,
                         rank=found_rank if rank is None else rank, shuffle=False)
        self.size = size
        self.num_samples = len(range(self.rank, size, self.num_replicas))  # the parent pads; no padding here
        self.total_size = size

    def __iter__(self):
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def eval_sampler(size: int) -> ShardSampler | None:
    """The sampler of an evaluation loader over ``size`` samples: this process's unpadded shard when
    a process group of more than one process exists, else None (every sample, in order)."""
    return ShardSampler(size) if world()[1] > 1 else None
