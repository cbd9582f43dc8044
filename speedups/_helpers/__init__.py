"""Private helpers every concern uses; each module is imported from here only, by its full path.

``env`` and ``environments`` (which process am I, which device is mine: one class per launch style),
``validate`` (argument checks), ``tree`` (nested containers), ``moving`` (one leaf to a device), ``rng``
(global RNG states), ``hardware`` (CPU features and counts), ``oom`` (out of memory), ``wrappers`` (DDP,
DataParallel and ``torch.compile`` unwrapped), ``step_context`` (the optimizer update a step and
``mixed_precision`` share), ``holds`` (one writer per path, and the files forked children drop),
``state_strides`` (optimizer state and gradients laid out as their parameters), ``compat`` (torch's private
APIs, in one place).
"""

__all__: list[str] = []
