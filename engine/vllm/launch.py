"""Building blocks for several front ends on one vLLM engine core (``voicegw.group`` starts and
supervises the processes): the engine core's launch for N clients with vLLM's own multi-client
front end (what ``vllm serve --api-server-count N`` uses), the frame table's share per client and
the group's decoder process plan.

vLLM's launcher changed shape between releases (listeners bound by the launcher in 0.3x, ZMQ
addresses bound by the clients in 0.26): :func:`launch_core` speaks both.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.vllm.channel import ENV_KEY, FrameTable
from engine.vllm.engine import VllmCodeEngine


def slots_per_client(max_num_seqs: int, count: int) -> int:
    """Frame-table slots one of ``count`` front ends hands out: the single front end's
    ``4 * max_num_seqs + 64`` shared out, each share keeping 64 spare (connections are spread by
    a hash, not evenly)."""
    return math.ceil(4 * max_num_seqs / count) + 64


@dataclass
class CoreLaunch:
    """One engine core started by :func:`launch_core`, for as long as it runs."""

    manager: Any
    """vLLM's engine process manager (``processes``, ``shutdown()``)."""
    coordinator: Any
    """vLLM's DP coordinator, or None (one rank)."""
    clients: list[Any]
    """What ``spawn`` returned."""
    listeners: Any = None
    """vLLM 0.3x: the client endpoints the launcher bound (``EngineZmqListeners``). Held until the
    core stops: vLLM removes their IPC files when the object goes (its ``__del__``), and an engine
    core that has not connected its output socket by then retries a missing path forever (its
    clients then never get a reply)."""

    def stop(self) -> None:
        """Stop the engine core (and coordinator), then remove the endpoints' IPC files."""
        for obj in (self.manager, self.coordinator):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.shutdown()
        if self.listeners is not None:
            with contextlib.suppress(Exception):
                self.listeners.cleanup()
            self.listeners = None


def launch_core(vllm_config: Any, count: int, spawn: Callable[[list[dict[str, Any]]], list[Any]]) -> CoreLaunch:
    """Start vLLM's engine core(s) for ``count`` clients; ``spawn(client_configs)`` starts the
    client processes while the engine starts (vLLM's handshake waits for both)."""
    from vllm.v1.engine import utils as vu
    from vllm.v1.executor import Executor

    executor = Executor.get_class(vllm_config)
    if hasattr(vu, "bind_engine_zmq_listeners"):  # vLLM 0.3x: the launcher binds, clients inherit
        listeners = vu.bind_engine_zmq_listeners(vllm_config, count)
        try:
            with vu.launch_core_engines(vllm_config, executor, False, listeners.addresses) as launch:
                stats = launch.coordinator.get_stats_publish_address() if launch.coordinator else None
                configs = []
                for i, (inp, out) in enumerate(zip(listeners.inputs, listeners.outputs, strict=True)):
                    c: dict[str, Any] = {
                        "input_address": inp.address, "output_address": out.address,
                        "input_listener": inp.socket, "output_listener": out.socket,
                        "client_count": count, "client_index": i,
                    }
                    if stats is not None:
                        c["stats_update_address"] = stats
                    configs.append(c)
                procs = spawn(configs)
                for listener in (*listeners.inputs, *listeners.outputs):
                    listener.close()  # the clients hold the listening sockets now; the files stay
                launch.watched_frontend_processes = procs
        except BaseException:
            listeners.cleanup()
            raise
        return CoreLaunch(launch.engine_manager, launch.coordinator, procs, listeners)
    old: Any = vu  # vLLM 0.26 (the GPU hosts' release): the clients bind their addresses
    addresses = old.get_engine_zmq_addresses(vllm_config, count)
    launched: Any
    with old.launch_core_engines(vllm_config, executor, False, addresses, count) as launched:
        manager, coordinator, addrs = launched[0], launched[1], launched[2]
        stats = coordinator.get_stats_publish_address() if coordinator else None
        configs = []
        for i in range(count):
            c = {"input_address": addrs.inputs[i], "output_address": addrs.outputs[i],
                 "client_count": count, "client_index": i}
            if stats is not None:
                c["stats_update_address"] = stats
            configs.append(c)
        procs = spawn(configs)
    return CoreLaunch(manager, coordinator, procs)


def core_config(proto: VllmCodeEngine, table: FrameTable, count: int, memory_share: float = 1.0) -> Any:
    """vLLM's engine config for a core shared by ``count`` clients, in this process's environment
    (the launch environment of ``proto``, the frame table's, the children's), with our model
    plugin registered. ``memory_share``: the part of ``gpu_memory_utilization`` this core takes
    (one of several engine cores on the device)."""
    from engine.vllm._env import child_env
    from engine.vllm.plugin import register

    for k, v in {**proto.launch_env(), ENV_KEY: table.spec.to_env(), **child_env()}.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    register()
    from vllm.usage.usage_lib import UsageContext

    args = proto.engine_args()
    args._api_process_count = count
    args._api_process_rank = -1
    args.gpu_memory_utilization *= memory_share
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def shared_decoder_plan(cfg: EngineConfig, model_dir: str, device: str, count: int,
                        cores: int = 1) -> tuple[Any, list[Any], list[Any], str]:
    """One decoder process for ``count`` clients of ``cores`` engine cores: its settings (slots per
    client), each client's share, the worker's ends and the samples file's path
    (``engine.decoder.client.shared_plan``)."""
    from engine.decoder.client import shared_plan
    from engine.speech import build_decoder

    settings = build_decoder(cfg, model_dir, device=cfg.decoder_device or device).settings
    settings.slots = math.ceil(2 * cfg.max_num_seqs * cores / count) + 32
    shares, theirs, path = shared_plan(settings, count)
    return settings, shares, theirs, path


def engine_dead(manager: Any) -> bool:
    """Whether a process of the engine core ``launch_core`` started has exited."""
    procs = getattr(manager, "processes", None) or []
    return any(not p.is_alive() for p in procs)
