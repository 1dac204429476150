"""The Python client of stepgate: publish a tool call as an intent, get its one answer.

A call is identified by where it came from — its step key (workflow_id,
step_index, tool, attempt) — never by its arguments: a retry the model
rephrased is the same step and gets the first answer back.
"""

from .client import Client, StepgateTimeout, Workflow, murmur2, partition_for

__all__ = ["Client", "StepgateTimeout", "Workflow", "murmur2", "partition_for"]
