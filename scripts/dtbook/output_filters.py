"""Filters for torchrun's own output, so a worker's one-line error is not buried under the launcher's.

Each filter is fed the output one line at a time and returns the lines to show instead (none, the
same line, or a summary). They hold state, so every process's output gets fresh instances.
"""

from __future__ import annotations


class AgentTracebackFilter:
    """Drop the torchrun agent's own Python traceback when a worker fails.

    When any worker exits non-zero, torchrun raises ChildFailedError and prints
    a dozen lines of its *own* call stack before the useful failure summary.
    That stack says nothing about the reader's program and buries the worker's
    one-line error, so it is replaced by one line; workers' output is untouched.
    """

    def __init__(self):
        self.pending: str | None = None
        self.skipping = False

    def feed(self, line: str) -> list[str]:
        if self.skipping:
            if line.startswith(" "):  # still inside the stack
                return []
            self.skipping = False  # the exception line ends the stack
            if "ChildFailedError:" in line:
                return ["torchrun: a worker failed (the launcher's own stack trace is omitted); summary:\n"]
            return ["torchrun failed (its own stack trace is omitted):\n", line]
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if "torchrun" in line or "torch/distributed/run.py" in line:
                self.skipping = True
                return []
            return [pending, line]
        if line.startswith("Traceback (most recent call last):"):
            self.pending = line
            return []
        return [line]


class ExitBarrierRaceFilter:
    """Condense torchrun's report of a known, harmless race at the end of a multi-agent run.

    After their workers finish, the agents of a multi-node job meet at an exit
    barrier held in the store of the agent that hosts it. If the host sets the
    last key and exits at once, another agent still waiting on the closed store
    logs a C++ stack and an "Error waiting on exit barrier" traceback, then
    exits normally (PyTorch issue 69520). The report is replaced by one line, and so
    are the echoes that follow it: more C++ stacks from the closed store and the
    agent's warnings that it cannot reach the rendezvous it is leaving.

    The same race has a second form: the last agent to leave finds the store already
    closed while it shuts the rendezvous down, logs a C++ stack ("recvVector failed")
    and then "has failed to shutdown the rendezvous". That report becomes one line too.
    """

    SUMMARY = ("torchrun: this agent lost the known exit-barrier race with the agent hosting the store "
               "(harmless; PyTorch issue 69520); its report is omitted\n")

    SHUTDOWN_SUMMARY = ("torchrun: this agent found the store already closed while leaving the "
                        "rendezvous (the same harmless race); its report is omitted\n")

    def __init__(self):
        self.held: list[str] = []  # store warnings that may turn out to be the start of the report
        self.in_report = False
        self.raced = False

    @staticmethod
    def _store_warning(line: str) -> bool:
        return "TCPStore.cpp" in line and any(
            f"{call} failed" in line for call in ("recvValueWithTimeout", "recvVector", "sendBytes"))

    @staticmethod
    def _stack_line(line: str) -> bool:
        return line.startswith(("Exception raised from", "frame #", "<omitting python frames>")) or not line.strip()

    def feed(self, line: str) -> list[str]:
        if "Error waiting on exit barrier" in line:
            self.held, self.in_report, self.raced = [], True, True
            return [self.SUMMARY]
        if self.in_report:
            if "elastic/agent/server/api.py:" in line:  # the logged traceback, one prefixed line at a time
                return []
            self.in_report = False
        if self.raced and (self._store_warning(line) or self._stack_line(line)
                           or ("dynamic_rendezvous.py" in line and "RendezvousConnectionError" in line)):
            return []
        if self.held and "has failed to shutdown the rendezvous" in line:
            self.held, self.raced = [], True
            return [self.SHUTDOWN_SUMMARY]
        if self._store_warning(line) or (self.held and self._stack_line(line)):
            self.held.append(line)
            return []
        if self.held:
            held, self.held = self.held, []
            return [*held, line]
        return [line]
