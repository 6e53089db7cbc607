"""The queries of jobs, their items and their results, in SQLAlchemy Core on an
`AsyncConnection`; the caller owns the transaction (`async with db.begin() as conn`). Files,
batches and API keys have their own modules beside this package.

Statuses: a job and each of its items go `queued` → `running` → `succeeded` | `failed` |
`cancelled`. A result row is unique per item and only the first delivery counts: it moves the
item to its terminal status and adds to the job's counters; the job is terminal once every item
has a result, or when it is cancelled. After a cancel only `abort` results are written.

Lock order, so that concurrent writers (several api replicas) never deadlock: a statement that
changes items first locks their jobs, in id order, then the items. Counters move by atomic
`UPDATE ... SET n = n + 1`, never read-modify-write.

The modules: `records` (statuses, records, columns, storable values), `statements` (the job
locks and the other pieces the writes share), `jobs` (create, mark running), `results` (record
results), `cancel` (cancel or fail open jobs), `retention` (delete finished jobs) and `reads`.
Callers use the names below as `store.<name>`.
"""

from tgq.api.db.store.cancel import cancel_job, fail_jobs
from tgq.api.db.store.jobs import create_job, create_jobs, item_rows, mark_running
from tgq.api.db.store.reads import (
    count_jobs_by_status,
    get_item_status,
    get_items,
    get_job,
    get_job_for_request,
    get_result,
    get_results,
    list_jobs,
    unfinished_items,
)
from tgq.api.db.store.records import (
    OPEN_STATUSES,
    TERMINAL_STATUSES,
    ItemRecord,
    JobRecord,
    NewJob,
    NewResult,
    ResultRecord,
    as_records,
    item_status,
    record_columns,
    storable,
    utc_now,
)
from tgq.api.db.store.results import record_results
from tgq.api.db.store.retention import delete_finished_before

__all__ = [
    "OPEN_STATUSES",
    "TERMINAL_STATUSES",
    "ItemRecord",
    "JobRecord",
    "NewJob",
    "NewResult",
    "ResultRecord",
    "as_records",
    "cancel_job",
    "count_jobs_by_status",
    "create_job",
    "create_jobs",
    "delete_finished_before",
    "fail_jobs",
    "get_item_status",
    "get_items",
    "get_job",
    "get_job_for_request",
    "get_result",
    "get_results",
    "item_rows",
    "item_status",
    "list_jobs",
    "mark_running",
    "record_columns",
    "record_results",
    "storable",
    "unfinished_items",
    "utc_now",
]
