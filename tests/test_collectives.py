"""Multi-GPU programs compiled without GPUs (mpjax.target_mesh) and their collectives, read."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax.collectives import parse_replica_groups

pytestmark = pytest.mark.usefixtures("gpu_compiler")  # compiles for GPU targets

BF16, F32 = jnp.bfloat16, jnp.float32


def on(mesh, shape, dtype, *spec):
  """An argument of ``shape`` and ``dtype`` placed on ``mesh`` as ``P(*spec)``."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


def gathers(report):
  return [c for c in report.collectives if c.kind == "all-gather"]


# --------------------------------------------------------------------------- target_mesh


def test_a_target_mesh_is_one_node_of_8_or_two_nodes_of_8_numbered_node_by_node():
  one = mpjax.target_mesh("h100", {"fsdp": 8})
  assert dict(one.shape) == {"fsdp": 8}
  assert [d.id for d in one.devices.flat] == list(range(8))
  assert {d.process_index for d in one.devices.flat} == {0}
  assert "H100" in one.devices.flat[0].device_kind

  two = mpjax.target_mesh("h100", {"data": 2, "fsdp": 8}, nodes=2)
  assert dict(two.shape) == {"data": 2, "fsdp": 8} and two.devices.size == 16
  # The first axis spans the nodes: row d of the mesh is node d, device i is in node i // 8.
  for node in range(2):
    assert [d.id for d in two.devices[node]] == list(range(8 * node, 8 * node + 8))
    assert {d.process_index for d in two.devices[node]} == {node}
  assert mpjax.target_mesh("h100", {"data": 2, "fsdp": 8}, nodes=2) is two  # cached


@pytest.mark.parametrize(
  "target, axes, nodes, message",
  [
    ("h100", {"data": 3, "fsdp": 5}, 2, r"15 devices, which 2 nodes cannot share equally"),
    ("h100", {"fsdp": 16}, 1, r"16 GPUs per node, but a NVIDIA H100 .* at most 8; pass nodes=2"),
    ("b200", {"data": 4, "fsdp": 8}, 2, r"at most 8; pass nodes=4"),
    ("h100", {"fsdp": 0}, 1, r"integer sizes >= 1"),
    ("h100", {"fsdp": 8}, 0, r"nodes must be an integer >= 1"),
    ("v100", {"fsdp": 8}, 1, r"unknown GPU target 'v100'"),
  ],
)
def test_a_target_mesh_that_cannot_be_built_is_refused_with_the_fix(target, axes, nodes, message):
  with pytest.raises(ValueError, match=message):
    mpjax.target_mesh(target, axes, nodes=nodes)


def test_compile_for_keeps_the_shardings_of_arguments_on_a_target_mesh_and_replicates_the_rest():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  w = on(mesh, (1024, 256), F32, "fsdp", None)
  scale = jnp.ones((256,), F32)  # not placed: replicated over the same mesh
  compiled = mpjax.compile_for(lambda w, s: w * s, w, scale, target="h100")
  (w_in, s_in), _ = compiled.input_shardings
  assert w_in == w.sharding and s_in == NamedSharding(mesh, P())
  # Without a placed argument compile_for keeps compiling for one GPU, as before.
  alone = mpjax.compile_for(lambda w, s: w * s, jax.ShapeDtypeStruct(w.shape, F32), scale)
  assert alone.input_shardings[0][0].num_devices == 1


def test_compile_for_refuses_arguments_on_two_meshes_or_on_another_gpus_mesh():
  h100 = mpjax.target_mesh("h100", {"fsdp": 8})
  a = on(h100, (64, 64), F32, "fsdp")
  b = on(mpjax.target_mesh("h100", {"data": 8}), (64, 64), F32, "data")
  with pytest.raises(ValueError, match="2 different meshes"):
    mpjax.compile_for(jnp.add, a, b)
  with pytest.raises(ValueError, match=r"placed on NVIDIA H100.* target='a100'"):
    mpjax.compile_for(jnp.add, a, a, target="a100")


# --------------------------------------------------------------------------- FSDP


def fsdp_forward(w, x):
  return x @ w.astype(BF16)  # an explicit cast of the f32 master weight for a bf16 GEMM


def test_an_fsdp_weight_is_gathered_in_bf16_within_one_node():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  w, x = on(mesh, (1024, 1024), F32, "fsdp", None), on(mesh, (256, 1024), BF16, "fsdp", None)
  report = mpjax.collective_report(mpjax.compile_for(fsdp_forward, w, x))
  (gather,) = gathers(report)
  # XLA casts each f32 shard (128 x 1024) to bf16, then gathers the whole weight in bf16.
  assert gather.dtype == "bfloat16" and gather.bytes == 1024 * 1024 * 2
  assert gather.dtypes == {"bfloat16": 1024 * 1024 * 2}
  assert gather.group_size == 8 and not gather.crosses_nodes
  # The op it carries: the GEMM's (jax 0.10.2) or the cast's (0.12.1), and the argument "w".
  assert gather.op_name.split("/")[-1] in ("dot_general", "convert_element_type")
  assert gather.carries == ("w",)
  assert gather.flags == () and report.flagged == ()
  # The ring estimate: 7/8 of the bytes over NVLink at 450 GB/s.
  assert gather.seconds == pytest.approx(1024 * 1024 * 2 * 7 / 8 / 450e9)
  assert report.bytes_by_kind == {"all-gather": 1024 * 1024 * 2}
  assert report.bytes_by_dtype == {"bfloat16": 1024 * 1024 * 2}


def test_on_two_nodes_the_fsdp_collectives_stay_in_a_node_and_the_data_one_crosses():
  mesh = mpjax.target_mesh("h100", {"data": 2, "fsdp": 8}, nodes=2)
  w, x = on(mesh, (1024, 1024), F32, "fsdp", None), on(mesh, (256, 1024), BF16, ("data", "fsdp"))

  def loss(w, x):
    return jnp.sum(fsdp_forward(w, x).astype(F32) ** 2)

  step = jax.jit(jax.grad(loss), out_shardings=w.sharding)
  report = mpjax.collective_report(mpjax.compile_for(step, w, x), gpus_per_node=8)
  by_kind = {c.kind: c for c in report.collectives}
  assert set(by_kind) == {"all-gather", "reduce-scatter", "all-reduce"}
  # Over "fsdp" (8 devices of one node): the weight's gather and its gradient's reduce-scatter.
  for kind in ("all-gather", "reduce-scatter"):
    assert by_kind[kind].group_size == 8 and not by_kind[kind].crosses_nodes
  assert by_kind["reduce-scatter"].bytes == 1024 * 1024 * 2  # its operand: the whole bf16 grad
  # Over "data" (one device of each node): the reduced shard, 128 x 1024 bf16, between nodes.
  across = by_kind["all-reduce"]
  assert across.group_size == 2 and across.crosses_nodes and across.bytes == 128 * 1024 * 2
  assert across.seconds == pytest.approx(2 * 128 * 1024 * 2 * (1 / 2) / 50e9)
  assert "across" in str(report) and "within" in str(report)


def test_nodes_are_read_from_the_meshs_device_order_not_the_partition_ids():
  devices = mpjax.target_mesh("h100", {"x": 16}, nodes=2).devices.reshape(2, 8)
  mesh = Mesh(devices.T, ("fsdp", "data"))  # fsdp runs within a node, data across
  w = on(mesh, (1024, 1024), F32, "fsdp", None)
  compiled = mpjax.compile_for(lambda w: w.astype(BF16) @ w.astype(BF16).T, w)
  (gather,) = gathers(mpjax.collective_report(compiled))
  assert gather.group_size == 8 and not gather.crosses_nodes
  # The text alone has partition ids only: partitions 0, 2, ..., 14 look like two nodes.
  (from_text,) = gathers(mpjax.collective_report(compiled.as_text()))
  assert from_text.crosses_nodes


# --------------------------------------------------------------------------- jax#23543


def test_a_cast_written_after_the_gather_is_moved_before_it_by_xla():
  """jax#23543's pattern: the f32 weight gathered whole (a sharding constraint, or shard_map's
  all_gather), then cast to bf16 for the GEMM. XLA (jax 0.10.2) moves the cast before the
  gather: the gather is bf16 and nothing is flagged."""
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  w, x = on(mesh, (1024, 1024), F32, "fsdp", None), on(mesh, (256, 1024), BF16, "fsdp", None)

  def constrained(w, x):
    return x @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())).astype(BF16)

  def explicit(w, x):
    gather = lambda w, x: x @ jax.lax.all_gather(w, "fsdp", tiled=True).astype(BF16)  # noqa: E731
    spec = P("fsdp", None)
    return jax.shard_map(gather, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(w, x)

  for fn in (constrained, explicit):
    (gather,) = gathers(mpjax.collective_report(mpjax.compile_for(fn, w, x)))
    assert (gather.dtype, gather.bytes, gather.flags) == ("bfloat16", 1024 * 1024 * 2, ())


def test_an_f32_gather_kept_by_a_barrier_is_flagged_and_casting_the_shard_first_halves_it():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  w, x = on(mesh, (1024, 1024), F32, "fsdp", None), on(mesh, (256, 1024), BF16, "fsdp", None)
  whole, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp", None))

  def gathered_then_cast(w, x):  # the barrier pins the gathered f32 value: XLA cannot move the cast
    return x @ jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(w, whole)).astype(BF16)

  def cast_then_gathered(w, x):  # the fix: cast the shard (pinned as the shard; on jax 0.10.2
    # casting before the gathered value is pinned is enough, the shard's constraint is a guard)
    w16 = jax.lax.with_sharding_constraint(w.astype(BF16), shard)
    return x @ jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(w16, whole))

  wide = mpjax.collective_report(mpjax.compile_for(gathered_then_cast, w, x))
  (gather,) = gathers(wide)
  assert (gather.dtype, gather.bytes) == ("float32", 1024 * 1024 * 4)
  assert gather.flags == ("gather-wide",)
  assert wide.flagged == (gather,) and "gather-wide" in str(wide)
  (fixed,) = gathers(mpjax.collective_report(mpjax.compile_for(cast_then_gathered, w, x)))
  assert (fixed.dtype, fixed.bytes * 2, fixed.flags) == ("bfloat16", gather.bytes, ())


def test_a_lookup_in_an_f32_table_then_cast_gathers_f32_and_is_flagged_unlike_cast_then_lookup():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  table, tokens = on(mesh, (4096, 512), F32, "fsdp", None), on(mesh, (64, 128), jnp.int32, "fsdp")

  def lookup_then_cast(table, tokens):
    return table[tokens].astype(BF16)

  def cast_then_lookup(table, tokens):
    return table.astype(BF16)[tokens]

  (wide,) = gathers(mpjax.collective_report(mpjax.compile_for(lookup_then_cast, table, tokens)))
  assert (wide.dtype, wide.bytes, wide.flags) == ("float32", 4096 * 512 * 4, ("gather-wide",))
  assert wide.carries == ("table",)
  (fixed,) = gathers(mpjax.collective_report(mpjax.compile_for(cast_then_lookup, table, tokens)))
  assert (fixed.dtype, fixed.bytes, fixed.flags) == ("bfloat16", 4096 * 512 * 2, ())


def test_a_tied_embedding_gathered_twice_in_one_combined_gather_flags_its_f32_part():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  table, tokens = on(mesh, (4096, 512), F32, "fsdp", None), on(mesh, (64, 128), jnp.int32, "fsdp")

  def tied(table, tokens):  # the lookup casts after, the output projection before
    return table[tokens].astype(BF16) @ table.T.astype(BF16)

  (gather,) = gathers(mpjax.collective_report(mpjax.compile_for(tied, table, tokens)))
  # XLA combines both gathers of the table: f32 for the lookup, bf16 for the projection.
  assert gather.dtypes == {"float32": 4096 * 512 * 4, "bfloat16": 4096 * 512 * 2}
  assert gather.dtype == "float32" and gather.flags == ("gather-wide",)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("compute, flagged", [(BF16, True), (F32, False)])
def test_a_bf16_gradient_reduction_is_flagged_against_an_f32_reduce_dtype(compute, flagged):
  mesh = mpjax.target_mesh("h100", {"data": 8})
  w, x = on(mesh, (512, 512), F32), on(mesh, (256, 512), F32, "data")  # w replicated

  def loss(w, x):
    return jnp.mean((x.astype(compute) @ w.astype(compute)).astype(F32) ** 2)

  compiled = mpjax.compile_for(jax.jit(jax.grad(loss), out_shardings=w.sharding), w, x)
  report = mpjax.collective_report(compiled, reduce_dtype="float32")
  (grad,) = [c for c in report.collectives if c.bytes == 512 * 512 * np.dtype(compute).itemsize]
  assert grad.kind == "all-reduce" and grad.dtype == np.dtype(compute).name
  assert grad.group_size == 8 and grad.op_name
  assert (grad.flags == ("reduce-narrow",)) is flagged
  assert mpjax.collective_report(compiled).flagged == ()  # no reduce_dtype, no flag


def test_a_scanned_layers_collectives_count_once_per_layer():
  mesh = mpjax.target_mesh("h100", {"fsdp": 8})
  ws, x = on(mesh, (4, 512, 512), F32, None, "fsdp", None), on(mesh, (64, 512), BF16, "fsdp")

  def forward(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.astype(BF16)), None), x, ws)[0]

  report = mpjax.collective_report(mpjax.compile_for(forward, ws, x))
  (gather,) = gathers(report)
  assert gather.count == 4 and gather.bytes == 512 * 512 * 2
  assert report.bytes_by_kind["all-gather"] == 4 * 512 * 512 * 2
  assert report.seconds == pytest.approx(4 * gather.seconds)
  assert "all-gather x4" in str(report)
  assert json.loads(json.dumps(report.to_dict()))["collectives"][0]["count"] == 4


# --------------------------------------------------------------------------- HLO text


def test_explicit_replica_groups():
  assert parse_replica_groups("{{0,1,2,3},{4,5,6,7}}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert parse_replica_groups("{{0,4},{1,5},{2,6},{3,7}}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]  # every device


def test_iota_replica_groups():
  assert parse_replica_groups("[2,8]<=[16]") == [list(range(8)), list(range(8, 16))]
  assert parse_replica_groups("[1,4]<=[4]") == [[0, 1, 2, 3]]
  # arange(16) as 4 x 4, transposed: each group is a column of the 4 x 4.
  assert parse_replica_groups("[4,4]<=[4,4]T(1,0)") == [
    [0, 4, 8, 12],
    [1, 5, 9, 13],
    [2, 6, 10, 14],
    [3, 7, 11, 15],
  ]
  # arange(8) as 2 x 4, transposed to 4 x 2, read as 4 groups of 2.
  assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
  # arange(8) as 2 x 2 x 2 with the last two dims swapped: [[0,2],[1,3]],[[4,6],[5,7]].
  assert parse_replica_groups("[2,4]<=[2,2,2]T(0,2,1)") == [[0, 2, 1, 3], [4, 6, 5, 7]]


def test_mesh_axes_replica_groups_as_xla_writes_them():
  # Two nodes of 8 as XLA writes data x fsdp: mesh (fsdp=8, 1, data=2) over devices
  # [2,8]T(1,0), i.e. entry (f, 0, d) is device 8 d + f.
  mesh = "mesh['axis_0'=8,'axis_1'=1,'axis_2'=2], device_ids=([2,8]T(1,0))"
  assert parse_replica_groups(mesh + " {'axis_0'}") == [list(range(8)), list(range(8, 16))]
  assert parse_replica_groups(mesh + " {'axis_2'}") == [[f, 8 + f] for f in range(8)]
  assert parse_replica_groups("mesh['axis_0'=16,'axis_1'=1] {'axis_0'}") == [list(range(16))]
  # Sub-axes of a = 8: (1)2 is the major factor 2 of [1,2,4]; (1)2 with (4)2 span [2,_,2].
  assert parse_replica_groups("mesh['a'=8] {'a':(1)2}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert parse_replica_groups("mesh['a'=8] {'a':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert parse_replica_groups("mesh['a'=8] {'a':(1)2,'a':(4)2}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
  with pytest.raises(ValueError, match="cannot read"):
    parse_replica_groups("<=[8]")


HLO = """HloModule m, num_partitions=16

ENTRY %main (p0: f32[64,256], p1: bf16[64,256], p2: bf16[1024]) -> bf16[1024] {
  %p0 = f32[64,256]{1,0} parameter(0), metadata={op_name="params['a']"}
  %p1 = bf16[64,256]{1,0} parameter(1), metadata={op_name="params['b']"}
  %ags = ((f32[64,256]{1,0}, bf16[64,256]{1,0}), (f32[1024,256]{1,0}, bf16[1024,256]{1,0})) all-gather-start(%p0, %p1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/dot_general"}
  %agd = (f32[1024,256]{1,0}, bf16[1024,256]{1,0}) all-gather-done(%ags)
  %p2 = bf16[1024]{0} parameter(2)
  %cp = bf16[1024]{0} collective-permute(%p2), channel_id=2, source_target_pairs={{0,1},{7,8}}
  ROOT %ar = bf16[1024]{0} all-reduce(%cp), channel_id=3, replica_groups=[8,2]<=[2,8]T(1,0), use_global_device_ids=true, to_apply=%add
}
"""  # noqa: E501


def test_a_combined_collective_sums_its_parts_and_names_the_dtype_that_moves_most():
  report = mpjax.collective_report(HLO, target="b200", reduce_dtype=F32)
  gather, permute, reduce = report.collectives
  f32, bf16 = 1024 * 256 * 4, 1024 * 256 * 2
  assert gather.kind == "all-gather" and gather.name == "ags" and gather.count == 1
  assert (gather.dtype, gather.bytes) == ("float32", f32 + bf16)
  assert gather.dtypes == {"float32": f32, "bfloat16": bf16}
  assert gather.group_size == 16 and gather.crosses_nodes
  assert gather.carries == ("params['a']", "params['b']")
  assert gather.seconds == pytest.approx((f32 + bf16) * 15 / 16 / 100e9)  # B200: 800 Gb/s NICs
  # The permute's pair {7, 8} joins node 0 and node 1.
  assert permute.kind == "collective-permute"
  assert permute.group_size == 4 and permute.crosses_nodes
  assert permute.seconds == pytest.approx(1024 * 2 / 100e9)
  # [8,2]<=[2,8]T(1,0): groups {f, 8 + f}, across the two nodes; bf16 under an f32 reduce_dtype.
  assert (reduce.group_size, reduce.crosses_nodes, reduce.flags) == (2, True, ("reduce-narrow",))
  assert report.bytes_by_dtype == {"float32": f32, "bfloat16": bf16 + 2 * 1024 * 2}
  # With nodes of 16 GPUs nothing crosses, and NVLink 5 (900 GB/s) carries it all.
  inside = mpjax.collective_report(HLO, target="b200", gpus_per_node=16).collectives[0]
  assert not inside.crosses_nodes and inside.seconds == pytest.approx(gather.seconds / 9)


def test_the_report_refuses_what_is_not_compiled_hlo():
  with pytest.raises(TypeError, match="compiled program"):
    mpjax.collective_report(42)
  with pytest.raises(ValueError, match="no ENTRY computation"):
    mpjax.collective_report("module @jit_f { func.func public @main() }")
