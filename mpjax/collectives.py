"""The collectives of a compiled multi-GPU program: what crosses NVLink and the network, and how.

A program compiled for a :func:`mpjax.target_mesh` (on any machine, with
:func:`mpjax.compile_for`) holds the NCCL collectives XLA:GPU will run.
:func:`collective_report` lists them with the dtype and bytes each moves, the
devices taking part (and whether they span nodes), a ring-algorithm time
estimate and flags for precision mistakes. The HLO is read with :mod:`mpjax.hlo`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from mpjax.gpu import GpuTarget, get_target
from mpjax.hlo import (
  Instruction,
  array_type,
  backend_config,
  called_computations,
  computations,
  entry_computation,
  metadata_op_name,
  type_bytes,
)

__all__ = ["KINDS", "Collective", "CollectiveReport", "collective_report", "parse_replica_groups"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
"""The collectives read, by the HLO opcode of their synchronous form."""


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program.

  Attributes:
    kind: one of :data:`KINDS` (an async ``-start``/``-done`` pair is one, named by its start).
    name: the HLO instruction.
    dtype: the element type moved, a numpy name (``"bfloat16"``); in a combined
      collective of several types, the one that moves the most bytes.
    bytes: bytes per device on the wire per run: an all-gather's result, the
      operand of the others; a combined collective's parts summed.
    group_size: devices per replica group (a collective-permute: the devices it involves).
    crosses_nodes: whether a group (or a permute's pair) spans two nodes.
    op_name: the ``op_name`` of its metadata (JAX's name stack for the op it serves).
    seconds: the ring-algorithm estimate of one run, see :func:`collective_report`.
    flags: ``"gather-wide"``, ``"reduce-narrow"``, see :func:`collective_report`.
    dtypes: bytes per dtype (one entry unless a combined collective mixes types).
    count: runs per call of the program (a loop body's collectives run once per trip).
    carries: the ``op_name`` s of the program arguments it moves, where an
      operand is one or a cast of one (``"params['w']"``).
  """

  kind: str
  name: str
  dtype: str
  bytes: int
  group_size: int
  crosses_nodes: bool
  op_name: str
  seconds: float
  flags: tuple[str, ...] = ()
  dtypes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  count: int = 1
  carries: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
  """The collectives of a compiled program, with bytes, node crossings and a time estimate.

  Totals count each collective :attr:`Collective.count` times (loop trips).

  Attributes:
    collectives: each collective, in program order.
    target: the :class:`mpjax.GpuTarget` whose link bandwidths the estimate uses.
    gpus_per_node: GPUs per node: device ``i`` is in node ``i // gpus_per_node``.
  """

  collectives: tuple[Collective, ...]
  target: GpuTarget
  gpus_per_node: int = 8

  @property
  def bytes_by_kind(self) -> dict[str, int]:
    """Bytes per device per call, by kind."""
    return dict(sum((Counter({c.kind: c.bytes * c.count}) for c in self.collectives), Counter()))

  @property
  def bytes_by_dtype(self) -> dict[str, int]:
    """Bytes per device per call, by dtype (a combined collective's parts apart)."""
    parts = (Counter({d: n * c.count for d, n in c.dtypes.items()}) for c in self.collectives)
    return dict(sum(parts, Counter()))

  @property
  def total_bytes(self) -> int:
    """Bytes per device per call, all collectives."""
    return sum(c.bytes * c.count for c in self.collectives)

  @property
  def seconds(self) -> float:
    """The estimated time of all collectives, one after another (no overlap with compute)."""
    return sum(c.seconds * c.count for c in self.collectives)

  @property
  def flagged(self) -> tuple[Collective, ...]:
    """The collectives with a flag."""
    return tuple(c for c in self.collectives if c.flags)

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-ready values."""
    return {
      "target": self.target.name,
      "gpus_per_node": self.gpus_per_node,
      "total_bytes": self.total_bytes,
      "bytes_by_kind": self.bytes_by_kind,
      "bytes_by_dtype": self.bytes_by_dtype,
      "seconds": self.seconds,
      "flagged": len(self.flagged),
      "collectives": [dataclasses.asdict(c) for c in self.collectives],
    }

  def __str__(self) -> str:
    ops = [c.op_name + (f" [{', '.join(c.carries)}]" * bool(c.carries)) for c in self.collectives]
    w = max(map(len, ["op_name", *ops]))
    lines = [f"{'kind':<22}{'dtype':<15}{'MB':>9} group nodes   time ms  {'op_name':<{w}}  flags"]
    for c, op in zip(self.collectives, ops, strict=True):
      kind = c.kind + (f" x{c.count}" if c.count > 1 else "")
      line = f"{kind:<22}{c.dtype:<15}{c.bytes / 1e6:>9.2f} {c.group_size:>5} "
      line += f"{'across' if c.crosses_nodes else 'within'}  {c.seconds * 1e3:>8.3f}  {op:<{w}}"
      lines.append(f"{line}  {','.join(c.flags)}".rstrip())
    link = "NVLink" if self.target.nvlink_gbps else "PCIe"
    lines.append(
      f"total: {len(self.collectives)} collectives, {self.total_bytes / 1e6:.2f} MB per device, "
      f"~{self.seconds * 1e3:.3f} ms on {self.target.name} (ring estimate at {link} "
      f"{self.target.node_link_gbps:g} GB/s within a node, {self.target.network_gbps:g} GB/s "
      f"across nodes); {len(self.flagged)} flagged"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- replica groups


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
  """The device groups of a ``replica_groups=`` value, in each form XLA writes.

  * explicit: ``{{0,1,2,3},{4,5,6,7}}`` (``{}``: all ``num_devices`` in one
    group); a collective-permute's ``source_target_pairs`` read the same way.
  * iota: ``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)``: ``arange`` of the size of
    the dims after ``<=``, reshaped to them, transposed by ``T``, reshaped to
    ``[groups, size]``.
  * mesh axes: ``mesh['a'=2,'b'=4] {'b'}`` (with ``, device_ids=([4,2]T(1,0))``
    after the mesh where its devices are not in order): a group is the devices
    that differ only along the braced axes (``'b':(1)2``: a sub-axis of size 2
    after a pre-size of 1).

  The ids are partition ids: positions in the device order of the mesh the
  program was compiled for.

  Args:
    text: the value as printed (for the mesh form, with its ``device_ids``).
    num_devices: the program's device count, needed only for ``{}``.

  Returns:
    The groups, each a list of ids.

  Raises:
    ValueError: for a form it cannot read.

  Example:
    >>> from mpjax.collectives import parse_replica_groups
    >>> parse_replica_groups("{{0,2},{1,3}}")
    [[0, 2], [1, 3]]
    >>> parse_replica_groups("[2,4]<=[4,2]T(1,0)")
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    >>> parse_replica_groups("mesh['data'=2,'fsdp'=4] {'data'}")
    [[0, 4], [1, 5], [2, 6], [3, 7]]
  """
  text = text.strip()
  if text.startswith("mesh"):
    return _mesh_groups(text)
  iota = re.fullmatch(r"\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", text.replace(" ", ""))
  if iota:
    return _iota(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
  if text.startswith("{"):
    groups = [[int(i) for i in re.findall(r"\d+", g)] for g in re.findall(r"\{([\d,\s]*)\}", text)]
    groups = [g for g in groups if g]
    if groups or num_devices is None:
      return groups
    return [list(range(num_devices))]
  raise ValueError(f"parse_replica_groups: cannot read replica groups {text!r}.")


def _iota(text: str) -> np.ndarray:
  """``[d0,d1,...]`` or ``[d0,d1,...]T(p0,p1,...)``: arange reshaped, then transposed."""
  match = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.replace(" ", ""))
  if match is None:
    raise ValueError(f"parse_replica_groups: cannot read the iota {text!r}.")
  dims = [int(d) for d in match.group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if match.group(2):
    ids = ids.transpose([int(p) for p in match.group(2).split(",")])
  return ids


def _mesh_groups(text: str) -> list[list[int]]:
  """XLA's mesh-axes form: ``mesh[axes][, device_ids=(...)] {grouped axes}``."""
  match = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{(.*)\}", text)
  if match is None:
    raise ValueError(f"parse_replica_groups: cannot read the mesh replica groups {text!r}.")
  axes = re.findall(r"'?([^',=]+)'?=(\d+)", match.group(1))
  names, sizes = [a.strip() for a, _ in axes], [int(n) for _, n in axes]
  total = int(np.prod(sizes))
  ids = match.group(2)
  if ids is None:
    devices = np.arange(total)
  elif re.fullmatch(r"\[[\d,]+\](?:T\([\d,]+\))?", ids.replace(" ", "")):
    devices = _iota(ids).reshape(-1)
  else:
    devices = np.array([int(i) for i in re.findall(r"\d+", ids)])
  refs = re.findall(r"'?([^',:{}]+?)'?(?::\((\d+)\)(\d+))?\s*(?:,|$)", match.group(3).strip())
  dims, grouped = [], []  # the mesh's dims split at sub-axes; those the groups span
  for name, size in zip(names, sizes, strict=True):
    on_axis = [(int(pre or 1), int(sub or size)) for ref, pre, sub in refs if ref.strip() == name]
    position, prefix = {}, 1
    for pre, sub in sorted(on_axis):
      if pre != prefix:  # the factor before a sub-axis that no grouped sub-axis covers
        dims.append(pre // prefix)
        prefix = pre
      position[pre] = len(dims)
      dims.append(sub)
      prefix *= sub
    if prefix != size or not on_axis:
      dims.append(size // prefix)
    grouped += [position[pre] for pre, _ in on_axis]  # in the order the axes are listed
  rest = [d for d in range(len(dims)) if d not in grouped]
  group_size = int(np.prod([dims[d] for d in grouped]))
  arranged = devices.reshape(dims).transpose(rest + grouped)
  return arranged.reshape(total // group_size, group_size).tolist()


# --------------------------------------------------------------------------- the program
# Ops that only move or view data: a narrowing convert after them could run before them.
_MOVES = frozenset("bitcast copy reshape transpose slice dynamic-slice gather broadcast".split())
# Ops that keep an argument what it is (a cast, a view): what a collective "carries".
_CASTS = frozenset("parameter convert bitcast copy reshape transpose".split())
_Uses = dict[str, list[tuple[Instruction, int]]]
# The computations that control flow runs, by the attributes that name them.
_CALLS = {
  "while": ("body",),
  "conditional": ("branch_computations", "true_computation", "false_computation"),
  "call": ("to_apply", "calls"),
  "async-start": ("calls",),
}


def _float_bits(dtype: str) -> int | None:
  """The width of a float dtype (a numpy name), ``None`` for other types."""
  return np.dtype(dtype).itemsize * 8 if dtype.startswith(("float", "bfloat")) else None


def _ring_seconds(kind: str, nbytes: int, n: int, gbps: float) -> float:
  """A ring algorithm's time: all-gather and reduce-scatter move ``(n-1)/n`` of the bytes,
  all-reduce twice that (a reduce-scatter then an all-gather), the others all of them."""
  share = {"all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-reduce": 2 * (n - 1) / n}
  return nbytes * share.get(kind, 1.0) / (gbps * 1e9) if n > 1 else 0.0


@dataclasses.dataclass
class _Program:
  """A compiled program's computations, and what reading its collectives needs."""

  comps: dict[str, list[Instruction]]
  devices: list[int]  # the device id of each partition
  gpus_per_node: int
  target: GpuTarget
  reduce_bits: int | None
  users: dict[str, _Uses] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for comp, instrs in self.comps.items():
      uses: _Uses = self.users.setdefault(comp, {})
      for instr in instrs:
        for position, (name, _) in enumerate(instr.operands):
          uses.setdefault(name, []).append((instr, position))

  def node(self, i: int) -> int:
    return (self.devices[i] if i < len(self.devices) else i) // self.gpus_per_node

  def walk(self, comp: str, count: int = 1, seen: frozenset[str] = frozenset()) -> Iterator:
    """Every instruction running ``comp`` runs, with how often: loop bodies once per trip
    (where XLA knows the trip count), called computations and conditional branches once."""
    for instr in self.comps.get(comp, ()):
      yield comp, instr, count
      called = " ".join(instr.attrs.get(k, "") for k in _CALLS.get(instr.opcode, ()))
      times = 1
      if instr.opcode == "while":
        times = int(backend_config(instr).get("known_trip_count", {}).get("n", 1))
      for inner in re.findall(r"[\w.\-]+", called):
        if inner in self.comps and inner not in seen:
          yield from self.walk(inner, count * times, seen | {comp})

  def narrowed(self, comp: str, name: str, bits: int, index: int | None, depth: int) -> bool:
    """Whether every use of value ``name`` (element ``index`` of a tuple) in ``comp`` ends in
    a convert to a float narrower than ``bits``, through ops that only move data and into
    fusions (following the fused computation's parameter)."""
    relevant = 0
    for user, position in self.users.get(comp, {}).get(name, []):
      if index is not None:  # a tuple: only its element ``index`` counts
        if user.opcode == "get-tuple-element" and user.attrs.get("index") != str(index):
          continue
        ok = user.opcode == "get-tuple-element" and self.narrowed(
          comp, user.name, bits, None, depth
        )
      elif user.opcode == "convert":
        ok = (_float_bits((array_type(user.type) or ("", ()))[0]) or bits) < bits
      elif user.opcode in _MOVES and position == 0 and depth < 16:
        ok = self.narrowed(comp, user.name, bits, None, depth + 1)
      elif user.opcode == "fusion" and depth < 16:
        fused = (called_computations(user) or [""])[0]
        params = [i for i in self.comps.get(fused, ()) if i.opcode == "parameter"]
        param = next((p for p in params if p.operands[:1] == [(str(position), None)]), None)
        ok = param is not None and self.narrowed(fused, param.name, bits, None, depth + 1)
      else:
        ok = False
      if not ok:
        return False
      relevant += 1
    return relevant > 0

  def gathers_wide(self, comp: str, instr: Instruction, dtypes: Sequence[str]) -> bool:
    """Whether a part of an all-gather is a float that every use converts to a narrower one."""
    result = instr.name
    if instr.opcode.endswith("-start"):  # the result is the matching -done's
      done = [u for u, _ in self.users[comp].get(instr.name, []) if u.opcode.endswith("-done")]
      if not done:
        return False
      result = done[0].name
    for index, dtype in enumerate(dtypes):
      bits = _float_bits(dtype)
      part = index if len(dtypes) > 1 else None
      if bits is not None and self.narrowed(comp, result, bits, part, 0):
        return True
    return False

  def carried(self, comp: str, names: Sequence[str]) -> tuple[str, ...]:
    """The ``op_name`` s of the program arguments that values ``names`` are, or casts of."""
    by_name = {i.name: i for i in self.comps[comp]}
    found = []
    for name in names:
      instr = by_name.get(name)
      for _ in range(8):  # up through casts, bitcasts and fusions of nothing else
        if instr is None or instr.opcode == "parameter" or len(instr.operands) != 1:
          break
        fused = [i.opcode for c in called_computations(instr) for i in self.comps.get(c, ())]
        if instr.opcode not in _CASTS and not (instr.opcode == "fusion" and set(fused) <= _CASTS):
          break
        instr = by_name.get(instr.operands[0][0])
      if instr is not None and instr.opcode == "parameter" and metadata_op_name(instr):
        found.append(metadata_op_name(instr))
    return tuple(dict.fromkeys(found))

  def groups(self, instr: Instruction) -> tuple[int, bool]:
    """``(group_size, crosses_nodes)`` of a collective."""
    if instr.opcode.startswith("collective-permute"):
      pairs = parse_replica_groups(instr.attrs.get("source_target_pairs", "{}"))
      crosses = any(len({self.node(i) for i in pair}) > 1 for pair in pairs)
      return len({i for pair in pairs for i in pair}), crosses
    text = instr.attrs.get("replica_groups", "{}")
    if "device_ids" in instr.attrs:  # the mesh form: its device order, printed after the mesh
      text += ", device_ids=" + instr.attrs["device_ids"]
    groups = parse_replica_groups(text, len(self.devices))
    crosses = any(len({self.node(i) for i in group}) > 1 for group in groups)
    return (len(groups[0]) if groups else 1), crosses

  def collective(self, comp: str, instr: Instruction, count: int) -> Collective | None:
    """The :class:`Collective` an instruction starts, or ``None`` where it starts none."""
    kind = instr.opcode.removesuffix("-start")
    if kind not in KINDS:
      return None
    group_size, crosses = self.groups(instr)
    types = {i.name: i.type for i in self.comps[comp]}
    operands = [written or types.get(name) for name, written in instr.operands]
    parts = [(array_type(t)[0], type_bytes(t)) for t in operands if array_type(t) is not None]
    if kind == "all-gather":  # its result: each operand from every device of the group
      parts = [(dtype, n * group_size) for dtype, n in parts]
    dtypes = dict(sum((Counter({dtype: n}) for dtype, n in parts), Counter()))
    nbytes = sum(dtypes.values())
    flags = []
    if kind == "all-gather" and self.gathers_wide(comp, instr, [d for d, _ in parts]):
      flags.append("gather-wide")
    narrow = self.reduce_bits or 0
    if kind in ("reduce-scatter", "all-reduce") and any(
      0 < (_float_bits(d) or 0) < narrow for d in dtypes
    ):
      flags.append("reduce-narrow")
    gbps = self.target.network_gbps if crosses else self.target.node_link_gbps
    dtype = max(dtypes, key=dtypes.__getitem__) if dtypes else ""
    seconds = _ring_seconds(kind, nbytes, group_size, gbps)
    carries = self.carried(comp, [name for name, _ in instr.operands])
    args = (group_size, crosses, metadata_op_name(instr), seconds, tuple(flags), dtypes, count)
    return Collective(kind, instr.name, dtype, nbytes, *args, carries)


def _device_ids(program: Any, num_devices: int) -> list[int]:
  """Each partition's device id: the compiled program's mesh devices in order, else itself."""
  shardings = [getattr(program, a, None) for a in ("input_shardings", "output_shardings")]
  for sharding in jax.tree.leaves(shardings):
    if isinstance(sharding, NamedSharding) and sharding.mesh.size == num_devices:
      return [int(d.id) for d in sharding.mesh.devices.flat]
  return list(range(num_devices))


def collective_report(
  compiled_or_hlo_text: Any,
  *,
  target: str | GpuTarget = "h100",
  gpus_per_node: int = 8,
  reduce_dtype: Any = None,
) -> CollectiveReport:
  """The collectives of a compiled program: dtypes, bytes, node crossings, time, flags.

  Reads the optimized HLO of a multi-GPU program, e.g. compiled by
  :func:`mpjax.compile_for` over a :func:`mpjax.target_mesh`. Device ``i`` (of
  the program's mesh; for HLO text, partition ``i``) is in node
  ``i // gpus_per_node``, as :func:`mpjax.target_mesh` numbers them.

  The time is a ring estimate with no latency and no overlap: ``bytes * (n-1)/n``
  over the link for an all-gather or reduce-scatter of ``n`` devices, twice that
  for an all-reduce, ``bytes`` for the others; at the target's
  :attr:`~mpjax.GpuTarget.node_link_gbps` within a node, its
  :attr:`~mpjax.GpuTarget.network_gbps` for a group that spans nodes. Flags:
  ``"gather-wide"``, an all-gather of a float whose every use converts it to a
  narrower float (through reshapes, slices, gathers and into fusions): the
  cast could run on the shard, before the gather; ``"reduce-narrow"``, a
  reduce-scatter or all-reduce of a float narrower than ``reduce_dtype``.

  Args:
    compiled_or_hlo_text: a ``jax.stages.Compiled`` or its ``as_text()``.
    target: a :data:`mpjax.TARGETS` name or a :class:`mpjax.GpuTarget`.
    gpus_per_node: GPUs per node.
    reduce_dtype: the dtype gradient reductions should run in (e.g.
      ``"float32"``), or ``None`` for no ``"reduce-narrow"`` flag.

  Returns:
    A :class:`CollectiveReport`.

  Raises:
    TypeError: for something that is neither a compiled program nor HLO text.
    ValueError: for text with no ``ENTRY`` computation or an unknown target.

  Example:
    >>> import mpjax
    >>> hlo = '''HloModule m, num_partitions=16
    ... ENTRY %main (p: f32[64,1024]) -> f32[1024,1024] {
    ...   %p = f32[64,1024]{1,0} parameter(0), metadata={op_name="w"}
    ...   ROOT %ag = f32[1024,1024]{1,0} all-gather(%p), channel_id=1,
    ...     replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true
    ... }'''
    >>> (ag,) = mpjax.collective_report(hlo, target="h100").collectives
    >>> ag.kind, ag.dtype, ag.bytes, ag.group_size, ag.crosses_nodes, ag.carries
    ('all-gather', 'float32', 4194304, 16, True, ('w',))
  """
  program = compiled_or_hlo_text
  text = program if isinstance(program, str) else getattr(program, "as_text", lambda: None)()
  if not isinstance(text, str):
    raise TypeError(
      "collective_report: pass a compiled program (jax.jit(f).lower(...).compile(), or "
      f"mpjax.compile_for) or its HLO text, got {type(program).__name__}."
    )
  entry = entry_computation(text)
  if entry is None:
    raise ValueError(
      "collective_report: no ENTRY computation in the HLO text (pass the compiled program's "
      "as_text(), not the lowered StableHLO)."
    )
  header = text[: text.find("\n")]
  num_devices = 1
  for key in ("num_partitions", "replica_count"):
    found = re.search(rf"{key}=(\d+)", header)
    num_devices *= int(found.group(1)) if found else 1
  reduce_bits = None if reduce_dtype is None else _float_bits(np.dtype(reduce_dtype).name)
  target = get_target(target)
  devices = _device_ids(program, num_devices)
  hlo = _Program(computations(text), devices, gpus_per_node, target, reduce_bits)
  found = [hlo.collective(comp, instr, count) for comp, instr, count in hlo.walk(entry)]
  return CollectiveReport(tuple(c for c in found if c is not None), target, gpus_per_node)
