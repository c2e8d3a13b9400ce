"""The replica: one engine process that claims generation jobs from its queue on the reply bus,
runs them on the engine and writes every token to the reply's token log.

Only the job and report formats are imported here: gateways use them without loading torch.
The worker itself is in fairway.replica.worker.
"""

from fairway.replica.job import GenerationJob, replica_queue
from fairway.replica.report import REPORTS_INBOX, ReplyReport

__all__ = ["REPORTS_INBOX", "GenerationJob", "ReplyReport", "replica_queue"]
