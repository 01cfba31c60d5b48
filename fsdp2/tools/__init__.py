"""fsdp2.tools: see inside a sharded run - the communication ledger and the analytic
expectation of a step's collectives.

Example:
    >>> from fsdp2.tools import CommLedger, expected_step_comms
    >>> ledger = CommLedger(expected_step_comms(model))
"""

from fsdp2.tools.comm_model import (
    CommExpectation,
    GroupSpec,
    ParamSpec,
    TransformerTP,
    expected_step_comms,
    groups_of,
)
from fsdp2.tools.ledger import CommLedger, LedgerRow, StepEntry, format_ledger

__all__ = [
    "CommLedger",
    "LedgerRow",
    "StepEntry",
    "format_ledger",
    "CommExpectation",
    "GroupSpec",
    "ParamSpec",
    "TransformerTP",
    "expected_step_comms",
    "groups_of",
]
