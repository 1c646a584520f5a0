"""The offloaded models of a captured step (CPU offload: each executor's host side, ``exe.offload``), around
the capture and its replays: their copy streams joined before a segment ends, their work in flight finished
before the capture and nothing left after it that names what it recorded, a replay cut short by a host call,
and the offloaded gradients stepped inside the step ([Note: offload under capture], runtime/offload/)."""

from __future__ import annotations

from ...errors import CaptureError


def offloads(refs) -> list:
    """The host sides (CPU offload: ``exe.offload``) of the executors behind the weak references ``refs``."""
    return [h for h in (getattr(r(), "offload", None) for r in refs) if h is not None]


def join_side_streams(refs) -> None:
    """Before a graph's segment ends: every offloaded model's copy streams joined (a capture ends joined)."""
    for host in offloads(refs):
        host.join_streams()


def graph_copies_used(refs) -> None:
    """[Note: offload under capture] gradients the step copied to the host are stepped by its own
    ``opt.step()``: one outside the step would read them before a replay's copies land."""
    for host in offloads(refs):
        if host.graph_copies:
            host.graph_copies = False
            raise CaptureError("shardplan.capture: the step copies the offloaded gradients to the host, but the "
                               "offloading optimizer does not step inside it: call opt.step() (and zero_grad) "
                               "inside the captured step, so that one replay is one optimizer step")


def host_boundary(refs, before: bool) -> None:
    """Around the capture, the host state of the executors the warm-up ran (offload: runtime/offload/): before
    it, their work in flight done; after it, nothing left that names what the capture recorded."""
    for host in offloads(refs):
        host.before_graph() if before else host.after_graph()


def cut_short(refs) -> None:
    """A replay cut short (a host call between the segments raised: [Note: a step in segments]): each host side
    settles its state so that the next call can capture again from it."""
    for host in offloads(refs):
        host.replay_cut_short()
