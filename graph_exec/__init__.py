"""graph_exec: pipeline-parallel training of MindSpore models with the MPipe Transpose schedule.

Importing the package is cheap: MindSpore is imported only by the parts that compute or
communicate, so planning and simulating work on a machine without MindSpore.
"""

__version__ = "0.1.0"
