"""Meshes: a torch DeviceMesh whose dim names come from ``dp``, ``cp``, ``pp``, ``tp`` (:data:`MESH_AXES`).

:func:`init_mesh` builds one from torchrun's environment (gloo on CPU, NCCL on CUDA);
:func:`mesh_info` reads this rank's :class:`~autopar.runtime.execution.rank_context.MeshInfo` off a mesh: its
coordinates, the process group of each axis and the global ranks along it.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.elastic import restart_safe_rendezvous
from autopar.errors import PlanError
from autopar.parallel_dims import MESH_AXES, ParallelDims, mesh_groups
from autopar.plan_model import MeshShape
from autopar.runtime.execution.rank_context import MeshInfo
from autopar.validation import check_mesh_degrees, parse_mesh_shape

__all__ = ["init_mesh", "MeshInfo", "mesh_info", "mesh_shape_of", "parse_mesh_shape"]

log = logging.getLogger(__name__)


def init_mesh(*, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, backend: str | None = None,
              timeout_s: float | None = None) -> DeviceMesh:
    """Initialise the default process group from torchrun's environment and build the dp x cp x pp x tp mesh
    (the cp dim only when ``cp > 1``: context parallelism, docs/context_parallel.md).

    ``timeout_s`` (default: torch's, 30 min on gloo, 10 on NCCL) becomes the timeout of the default
    group (when this call creates it) and of the mesh's axis groups: what bounds a collective on
    NCCL and an object collective anywhere. autopar's own tensor collectives on gloo wait at most
    compile's ``p2p_timeout_s`` whatever it is (:mod:`autopar.ops.comm_guard`).
    """
    check_mesh_degrees(dp=dp, pp=pp, tp=tp, cp=cp, backend=backend, timeout_s=timeout_s)  # autopar/validation.py
    shape = MeshShape(dp=dp, pp=pp, tp=tp, cp=cp)
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    if world != shape.world_size:
        raise PlanError(f"mesh {shape} needs {shape.world_size} ranks but the world has {world}",
                        where="init_mesh", fix=f"launch with torchrun --nproc-per-node {shape.world_size} "
                                               f"(or change dp/cp/pp/tp so their product is {world})")
    device = "cuda" if torch.cuda.is_available() and backend != "gloo" else "cpu"
    if not dist.is_initialized():
        # a prefix per torchrun attempt: a restarted job must not read the dead workers' addresses
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend or ("nccl" if device == "cuda" else "gloo"), **restart_safe_rendezvous(),
                                **timeout)
    names = tuple(a for a in MESH_AXES if a != "cp" or cp > 1)
    mesh = init_device_mesh(device, tuple(shape.dims.size(a) for a in names), mesh_dim_names=names)
    if timeout_s is not None:  # DeviceMesh makes its axis groups with torch's default timeout
        for axis in names:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), mesh.get_group(axis))
    return mesh


def mesh_shape_of(mesh: DeviceMesh) -> MeshShape:
    """The degrees of ``mesh``'s dims; checks their names and that the mesh covers the world."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in MESH_AXES]
    if not names or unknown:
        raise PlanError(f"mesh dim names {list(names)} include unknown {unknown}" if names
                        else "the DeviceMesh has no mesh_dim_names",
                        where="the DeviceMesh passed to compile",
                        fix=f"build it with mesh_dim_names drawn from {MESH_AXES}, e.g. autopar.init_mesh()")
    if mesh.size() != dist.get_world_size():
        raise PlanError(f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}",
                        where="the DeviceMesh passed to compile",
                        fix="use a mesh over every rank of the job (its degrees multiply to the world size)")
    return MeshShape(**{axis: mesh.size(names.index(axis)) if axis in names else 1 for axis in MESH_AXES})


def mesh_info(mesh: DeviceMesh, *, dims: ParallelDims | None = None) -> MeshInfo:
    """Read degrees, coordinates, groups and peers off ``mesh``; checks names and world size.

    ``dims`` (the Plan's, :attr:`autopar.plan_model.Plan.dims`): with expert parallelism, the ep and edp
    groups too, as dims of the same mesh (:func:`autopar.parallel_dims.mesh_groups`; collective: every
    rank calls it)."""
    shape = mesh_shape_of(mesh)
    names = tuple(mesh.mesh_dim_names)
    coordinate = mesh.get_coordinate()
    coords = {axis: coordinate[names.index(axis)] if axis in names else 0 for axis in MESH_AXES
              if axis != "cp" or shape.cp > 1}  # (as ParallelDims.coords: no cp coordinate without cp)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)
    info = MeshInfo(shape, dist.get_rank(), coords, device=device, dims=dims or shape.dims)
    for axis in MESH_AXES:
        if axis not in names:
            info.axis_ranks[axis] = [info.rank]
            info.groups[axis] = None
            continue
        info.axis_ranks[axis] = [int(r) for r in mesh[axis].mesh.tolist()]
        info.groups[axis] = mesh.get_group(axis)
    info.axis_ranks["dcp"], info.groups["dcp"] = info.axis_ranks["dp"], info.groups["dp"]  # cp = 1: dp itself
    if dims is not None:
        for axis, (group, ranks, _index) in mesh_groups(dims, mesh).items():
            info.groups[axis], info.axis_ranks[axis] = group, ranks
    return info
