"""A training step's time by category, read from the Chrome trace of ``torch.profiler`` (tools/profile_step.py).

Every op the step runs is given one category by what it is and where it runs (the first rule that holds, walking
from the op out through the ops and ``pretrain.scopes`` regions around it):

- communication: a collective (``c10d::``, ``nccl:``, ``gloo:`` ops, NCCL's kernels), wherever it is called from;
- matmul: an ``nn.Linear`` (``aten::linear``, or ZeRO-3's ``LinearFunctionForZeroStage3``: the mixers'
  projections, the feed-forward's, the LM head's), and a matmul inside the fused loss (the head's logits and
  gradients);
- optimizer / ZeRO: the ``optimizer`` region (``engine.step``: clipping, Adam, ZeRO's partitions and gathers, the
  gradient norm), gradient accumulation (``AccumulateGrad``, where ZeRO's gradient hooks run), ZeRO-3's functions
  around each module, and what ``engine.backward`` does outside autograd's nodes (DeepSpeed's gradient reduction).
  ZeRO-3 gathers a module's weights in hooks no op names: their copies land in the region of the module;
- the region the op runs in: ``mixer`` → mixer ops (feature maps, the attention or recurrence op, convolutions,
  gates, per-head norms aside), ``loss`` → loss, ``norm``, ``ffn`` (its activation) and ``block`` (the residual
  adds) → norms & elementwise; the embedding's lookup is elementwise too;
- compiled blocks (``train.compile``) have no regions inside (the compiler drops them), so a compiled graph's ops
  go by name: our ops (``pretrain::``, custom ops the graph calls) → mixer ops, a matmul → matmul, the rest of
  the graph (inductor's fused kernels: norms, activations, gates, residual adds) → norms & elementwise;
- other: an op outside every region (the task moving the batch to the device, the step's own flag).

A backward op takes the category of the forward op that made it (the trace's ``fwdbwd`` flows join them), so
"mixer" holds the mixer's forward and backward; ops that activation checkpointing reruns in backward land where
their forward does, and so count in the time, never in the FLOPs.

How time is counted depends on where the step runs:
- CUDA: the device's time. Each kernel (memcpy and memset included) belongs to the op that launched it; where
  kernels overlap (communication on its own stream beside compute), the overlap is counted once, as the
  compute's, so "communication" is the exposed part. The time no kernel runs is "device waits on host"; what
  the host does meanwhile is the main thread's time, counted as on CPU below (``host_by_name``).
- CPU: the main thread's time. Each op counts its self time (without the ops inside it); the time it waits
  outside its ops while gloo's threads run a collective is communication; the rest, "host, between ops", is
  Python, the data loader, DeepSpeed's and autograd's bookkeeping.
Either way the rows add up to the profiled steps' time, which ``profile_step`` prints beside its own clock's.
"""
import bisect
from collections import defaultdict
from dataclasses import dataclass

from pretrain import scopes

CATEGORIES = {  # key: the row's label
    "mixer": "mixer ops",
    "matmul": "matmuls (projections, feed-forward, head)",
    "elementwise": "norms, embedding & elementwise",
    "loss": "loss",
    "optimizer": "optimizer / ZeRO",
    "communication": "communication",
    "other": "other ops",
    "host": "host",  # relabelled by where the step ran (HOST_LABEL)
}
HOST_LABEL = {"cuda": "device waits on host", "cpu": "host, between ops (Python, data, bookkeeping)"}
REGION_CATEGORY = {scopes.MIXER: "mixer", scopes.LOSS: "loss", scopes.NORM: "elementwise", scopes.FFN: "elementwise",
                   scopes.BLOCK: "elementwise", scopes.OPTIMIZER: "optimizer", scopes.BACKWARD: "optimizer"}
EVALUATE = "autograd::engine::evaluate_function: "  # autograd's call of a backward node
COMMUNICATION = ("c10d::", "_c10d_functional::", "nccl", "gloo:", "record_param_comms")  # ops', kernels' names
NAMED = {  # an op's (or its autograd call's) name decides before the region it runs in: name prefix → category
    **dict.fromkeys(COMMUNICATION, "communication"),
    "aten::linear": "matmul",
    "LinearFunctionForZeroStage3": "matmul",  # ZeRO-3's own nn.Linear
    "torch::autograd::AccumulateGrad": "optimizer",  # where ZeRO's gradient hooks run
    EVALUATE + "torch::autograd::AccumulateGrad": "optimizer",
    "PreBackwardFunctionForModule": "optimizer",  # ZeRO-3's hooks around a module, forward and backward
    "PostBackwardFunctionModule": "optimizer",
    "aten::embedding": "elementwise",  # and its backward, aten::embedding_dense_backward
    "pretrain::": "mixer",  # our ops (pretrain/ops/custom_ops.py): how a compiled block's mixer shows in a trace
}
COMPILED_GRAPH = "## Call CompiledFxGraph"  # a compiled graph's run (forward or backward)
MATMULS = {"aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::baddbmm"}
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function", "Operator", "Runtime"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
STEP_PREFIX = "ProfilerStep#"


class Event:
    """A complete ("X") event of the trace, in µs; where it nests, and the forward op of a backward op, come later."""
    __slots__ = ("name", "cat", "thread", "start", "end", "args", "parent", "forward", "children_us", "category")

    def __init__(self, raw: dict):
        self.name, self.cat, self.thread = raw["name"], raw.get("cat", ""), (raw["pid"], raw["tid"])
        self.start = float(raw["ts"])
        self.end = self.start + float(raw.get("dur", 0))
        self.args = raw.get("args") or {}
        self.parent = self.forward = self.category = None  # forward: a backward op's forward op (fwdbwd flow)
        self.children_us = 0.0


@dataclass
class StepTime:
    """The profiled steps' time (µs, all steps) per category and per op (CPU) or kernel (CUDA) name in each, and
    the window the steps span."""
    by_name: dict[str, dict[str, float]]  # category → name → µs
    window_us: float
    steps: int
    device: str  # "cuda" or "cpu": what was counted
    host_by_name: dict[str, dict[str, float]]  # the main thread's time, as by_name is on CPU: what the device waits on
    kernels: dict[str, int] | None = None  # CUDA: kernels launched in the window by category (a host-bound step's cost)

    def kernels_per_step(self) -> dict[str, float] | None:
        return None if self.kernels is None else {key: n / self.steps for key, n in self.kernels.items()}

    def ms_per_step(self, host: bool = False) -> dict[str, float]:
        by_name = self.host_by_name if host else self.by_name
        return {key: sum(names.values()) / self.steps / 1e3 for key, names in by_name.items()}

    def top(self, category: str, count: int, host: bool = False) -> list[tuple[str, float]]:
        """The ``count`` names that take most of ``category``'s time: (name, ms per step)."""
        by_name = self.host_by_name if host else self.by_name
        names = sorted(by_name[category].items(), key=lambda item: -item[1])[:count]
        return [(name, us / self.steps / 1e3) for name, us in names]


def step_time(trace: dict) -> StepTime:
    """The categories of the steps marked ``ProfilerStep#N`` in a Chrome trace (``json.load``-ed): device time where
    the trace has kernels, else the main thread's (module doc)."""
    host, device, flows = [], [], defaultdict(dict)
    for raw in trace["traceEvents"]:
        phase, cat = raw.get("ph"), raw.get("cat", "")
        if phase == "X" and cat in HOST_CATS:
            host.append(Event(raw))
        elif phase == "X" and cat in DEVICE_CATS:
            device.append(Event(raw))
        elif phase in ("s", "f") and cat == "fwdbwd":
            flows[raw["id"]][phase] = ((raw["pid"], raw["tid"]), float(raw["ts"]))
    steps = sorted((e for e in host if e.cat == "user_annotation" and e.name.startswith(STEP_PREFIX)),
                   key=lambda e: e.start)
    if not steps:
        raise ValueError(f"the trace marks no steps ({STEP_PREFIX}N): profile with a torch.profiler schedule")
    window = (steps[0].start, steps[-1].end)
    _nest(host)
    _link_backward_to_forward(host, flows)
    host_by_name = _main_thread_time(host, _main_thread(host, window), window)
    if not device:
        return StepTime(host_by_name, window[1] - window[0], len(steps), "cpu", host_by_name)
    by_name, kernels = _device_time(device, host, window)
    return StepTime(by_name, window[1] - window[0], len(steps), "cuda", host_by_name, kernels)


def _nest(events: list[Event]) -> None:
    """Each host event's parent: the innermost event of its thread that encloses it; and its children's time."""
    by_thread = defaultdict(list)
    for event in events:
        by_thread[event.thread].append(event)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.start, -e.end))
        open_events: list[Event] = []
        for event in thread_events:
            while open_events and open_events[-1].end <= event.start:
                open_events.pop()
            if open_events:
                event.parent = open_events[-1]
                event.parent.children_us += event.end - event.start
            open_events.append(event)


def _link_backward_to_forward(events: list[Event], flows: dict) -> None:
    """Join each backward op (and autograd's call of it) to the forward op that made it: a flow's ends sit at the
    start of the two ops."""
    starting = {}
    for event in sorted(events, key=lambda e: e.start - e.end):  # the outermost of ops starting together wins
        if event.cat in ("cpu_op", "Operator"):
            starting.setdefault((event.thread, event.start), event)
    for ends in flows.values():
        if "s" in ends and "f" in ends:
            forward, backward = starting.get(ends["s"]), starting.get(ends["f"])
            if forward is not None and backward is not None and forward is not backward:
                backward.forward = forward
                if backward.parent is not None and backward.parent.name.startswith(EVALUATE):
                    backward.parent.forward = forward  # autograd's call of the node: its hooks, its checks


def category(event: Event) -> str:
    """The event's category by the rules of the module doc (cached on the event)."""
    if event.category is None:
        event.category = _classify(event)
    return event.category


def _classify(event: Event) -> str:
    in_matmul, node, seen = False, event, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        name = node.name
        named = next((kind for prefix, kind in NAMED.items() if name.startswith(prefix)), None)
        if named is not None:
            return named
        in_matmul = in_matmul or name in MATMULS
        if node.cat == "user_annotation" and name in REGION_CATEGORY:
            return "matmul" if name == scopes.LOSS and in_matmul else REGION_CATEGORY[name]
        if name.startswith(COMPILED_GRAPH):
            return "matmul" if in_matmul else "elementwise"
        node = node.forward or node.parent
    return "other"


def _main_thread(host: list[Event], window: tuple[float, float]) -> tuple:
    """The thread that runs the step: the one whose ops take most of the window (kineto may record the step's
    marks on a thread of their own)."""
    busy = defaultdict(float)
    for event in host:
        if event.cat in ("cpu_op", "Operator") and window[0] <= event.start < window[1]:
            busy[event.thread] += event.end - event.start - event.children_us
    return max(busy, key=busy.get) if busy else None


def _main_thread_time(host: list[Event], thread: tuple, window: tuple[float, float]) -> dict[str, dict[str, float]]:
    """CPU: each op's self time on the main thread within ``window``, by category and name; the rest is "host",
    but for the time it waits on a collective that gloo's threads run (outside any op of the main thread)."""
    totals = {key: defaultdict(float) for key in CATEGORIES}
    ops = [event for event in host if event.thread == thread and event.cat in ("cpu_op", "Operator")
           and window[0] <= event.start < window[1]]
    for event in ops:
        totals[category(event)][event.name] += max(0.0, event.end - event.start - event.children_us)
    counted = sum(sum(names.values()) for names in totals.values())
    between_ops = _outside(_merged((e.start, e.end) for e in ops), window)
    in_flight = _merged((e.start, e.end) for e in host if e.thread != thread and e.name.startswith("gloo:"))
    waiting = _overlap(between_ops, in_flight)
    if waiting:
        totals["communication"]["waiting for gloo"] = waiting
    totals["host"]["between ops"] = (window[1] - window[0]) - counted - waiting
    return totals


def _merged(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, as sorted disjoint ones."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def _outside(merged: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The parts of ``window`` that no interval of ``merged`` covers."""
    gaps, at = [], window[0]
    for start, end in merged:
        if start > at:
            gaps.append((at, min(start, window[1])))
        at = max(at, end)
    return gaps + ([(at, window[1])] if at < window[1] else [])


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length two unions of disjoint sorted intervals share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _device_time(device: list[Event], host: list[Event], window: tuple[float, float]
                 ) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """CUDA: the window's device time by the category of the op that launched each kernel; overlaps counted once
    (compute before communication), idle time as "host" (the device waits on it); and the kernels (copies and
    memsets too) that started in the window by category: each one a launch the host paid for."""
    launches = {}  # a kernel's launch: the runtime call with its correlation id, else the op with its external id
    for event in host:
        if event.cat in ("cuda_runtime", "cuda_driver", "Runtime") and "correlation" in event.args:
            launches[("correlation", event.args["correlation"])] = event
        elif event.cat in ("cpu_op", "Operator") and "External id" in event.args:
            launches[("External id", event.args["External id"])] = event
    kinds, counts = [], dict.fromkeys(CATEGORIES, 0)
    for kernel in device:
        start, end = max(kernel.start, window[0]), min(kernel.end, window[1])
        if end <= start:
            continue
        launcher = next((launches[key, kernel.args[key]] for key in ("correlation", "External id")
                         if (key, kernel.args.get(key)) in launches), None)
        if kernel.name.startswith(COMMUNICATION):
            kind = "communication"
        else:
            kind = category(launcher) if launcher is not None else "other"
        kinds.append((start, end, kind, kernel.name))
        counts[kind] += kernel.start >= window[0]  # one running into the window was launched before it
    return _sweep(kinds, window), counts


def _sweep(intervals: list[tuple[float, float, str, str]], window: tuple[float, float]) -> dict[str, dict[str, float]]:
    """Split ``window`` at the ends of every ``(start, end, category, name)``; each piece goes to one interval
    running then (compute before communication, then the one that started first), or to "host" when none runs."""
    totals = {key: defaultdict(float) for key in CATEGORIES}
    points = sorted({window[0], window[1], *(p for s, e, *_ in intervals for p in (s, e))})
    starts = sorted(intervals)
    active: list[tuple] = []  # (communication?, start, end, category, name), kept sorted
    next_interval = 0
    for left, right in zip(points, points[1:]):
        while next_interval < len(starts) and starts[next_interval][0] <= left:
            s, e, kind, name = starts[next_interval]
            bisect.insort(active, (kind == "communication", s, e, kind, name))
            next_interval += 1
        active = [a for a in active if a[2] > left]
        kind, name = active[0][3:] if active else ("host", "idle")
        totals[kind][name] += right - left
    return totals
