"""Exit codes of every `raypai` command (docs/interfaces.md, "Command line"); CLIs use these names.

0  OK        the command did what it was asked
1  FAILED    the work ran and did not succeed: a failed run or Ray job (with the resume command),
             a check that found a problem (doctor, `ray status`, `services status`), an error
             answer from the deploy API (`raypai deploy ...` prints its status and message)
2  REFUSED   refused before doing the work: invalid arguments, configuration or input, a name
             that does not exist, a port that is taken. Every RaypaiError that reaches the
             command line ends here, printed as one message naming the fix (no traceback);
             click's own usage errors use 2 as well
"""

OK = 0
FAILED = 1
REFUSED = 2

__all__ = ["OK", "FAILED", "REFUSED"]
