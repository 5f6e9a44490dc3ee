"""The graph layer: components and the signatures of their modes, the nodes
a walk is built from, stop rules, chunk policies, and the plan a walk
compiles to. A leaf: it imports neither torch nor the runtime."""

from mstar.graph.chunks import ChunkPolicy, FixedChunks, Items, Last, LeftContext, SlidingWindow
from mstar.graph.compile import (BindingError, PartitionPlan, StreamPlan, WalkPlan, compile_walk, compile_walks,
                                 samples, step_bindings)
from mstar.graph.nodes import Binding, Collect, Each, Emit, FanOut, Fork, Loop, Node, Partition, Step, Stream, Walk
from mstar.graph.program import Back, Enter, ForkRows, Instr, LoopPlan, Run
from mstar.graph.signatures import Component, In, Kind, Mode, Out
from mstar.graph.stops import AnyOf, EosToken, HostStop, MaxSteps, MaxTokens, StopRule, StreamDone, TokenIn

__all__ = [
    "AnyOf", "Back", "Binding", "BindingError", "ChunkPolicy", "Collect", "Component", "Each", "Emit", "Enter",
    "EosToken", "FanOut", "FixedChunks", "Fork", "ForkRows", "HostStop", "In", "Instr", "Items", "Kind", "Last",
    "LeftContext", "Loop", "LoopPlan", "MaxSteps", "MaxTokens", "Mode", "Node", "Out", "Partition", "PartitionPlan",
    "Run", "SlidingWindow", "Step", "StopRule", "Stream", "StreamDone", "StreamPlan", "TokenIn", "Walk", "WalkPlan",
    "compile_walk", "compile_walks", "samples", "step_bindings",
]
