"""The schema, in one place, with a word on every column."""

from __future__ import annotations

VERSION = 3

TABLES = """
-- Every node of the tree: the root, queues, state dirs, consumer views, messages.
CREATE TABLE IF NOT EXISTS entries (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,  -- the inode number; AUTOINCREMENT: never reused
    parent      INTEGER REFERENCES entries(id),     -- containing directory; NULL only for the root
    name        BLOB NOT NULL,                      -- exact bytes of the name (never decoded)
    kind        TEXT NOT NULL,                      -- root | queue | state | consumer | message
    queue       INTEGER,                            -- the queue entry this node belongs to
    state       TEXT,                               -- partial|ready|working|success|error (state dirs, views, messages)
    hidden      INTEGER NOT NULL DEFAULT 0,         -- 1: an upload into ready/ not yet closed; invisible
    blob        INTEGER REFERENCES blobs(id),       -- sealed, immutable content; NULL while staged
    staged      INTEGER NOT NULL DEFAULT 0,         -- 1: content is the mutable staging file staging/<id>
    size        INTEGER NOT NULL DEFAULT 0,         -- bytes of content
    mode        INTEGER NOT NULL,                   -- st_mode, type bits included
    uid         INTEGER NOT NULL DEFAULT 0,
    gid         INTEGER NOT NULL DEFAULT 0,
    mtime_ns    INTEGER NOT NULL,
    ctime_ns    INTEGER NOT NULL,
    created_ns  INTEGER NOT NULL,                   -- when the node was made
    enqueued_ns INTEGER,                            -- when it last entered ready/ (order of the line)
    claimed_ns  INTEGER,                            -- when it was last claimed
    finished_ns INTEGER,                            -- when it last reached success/ or error/
    attempts    INTEGER NOT NULL DEFAULT 0,         -- claims so far
    consumer    TEXT,                               -- name of the consumer view holding it, if any
    error       BLOB,                               -- last failure reason (user.spool.error)
    lease_ns    INTEGER,                            -- in working/: when the claim's lease runs out
    retry_ns    INTEGER,                            -- in error/: when it goes back to ready/
    abandoned   INTEGER NOT NULL DEFAULT 0,         -- in error/: out of attempts, stays until redriven
    duplicate_of INTEGER,                           -- skipped as a duplicate of this message
    atime_ns    INTEGER,                            -- last access time when set apart (touch -a); NULL: mtime_ns
    UNIQUE (parent, name)
);

-- Content, addressed by SHA-256, shared by every message that references it.
CREATE TABLE IF NOT EXISTS blobs (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,  -- names the file blobs/ab/cd/<sha>.<id> when not inline
    sha256   BLOB NOT NULL UNIQUE,               -- 32 raw bytes
    size     INTEGER NOT NULL,
    refcount INTEGER NOT NULL CHECK (refcount >= 0),  -- messages referencing it
    data     BLOB                                -- the content itself when small; NULL: in a file
);

-- User headers (user.* xattrs other than user.spool.*), carried through every state.
CREATE TABLE IF NOT EXISTS xattrs (
    entry INTEGER NOT NULL REFERENCES entries(id) ON DELETE CASCADE,
    name  BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (entry, name)
);

-- Every transition of a message: who, when, from where, to where, why.
CREATE TABLE IF NOT EXISTS history (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    entry   INTEGER NOT NULL,                    -- message id (kept after the message is gone)
    at_ns   INTEGER NOT NULL,
    action  TEXT NOT NULL,                       -- an Action value
    src     TEXT,                                -- state[/consumer] before
    dst     TEXT,                                -- state[/consumer] after
    uid     INTEGER,
    pid     INTEGER,
    reason  TEXT
);
CREATE INDEX IF NOT EXISTS history_entry ON history(entry);

-- Lifecycle settings per queue (core/policy.py); a key not here has its default.
CREATE TABLE IF NOT EXISTS policies (
    queue INTEGER NOT NULL REFERENCES entries(id) ON DELETE CASCADE,
    key   TEXT NOT NULL,
    value TEXT NOT NULL,                         -- canonical text (policy.show)
    PRIMARY KEY (queue, key)
);

CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

# Created after MIGRATIONS, so that they may name columns an older store lacks.
INDEXES = """
-- The lifecycle's timers: due leases, due retries, finished messages by age. Partial indexes:
-- only messages that have the time are in them (and, finished, no retry to wait for: those
-- are never purged).
CREATE INDEX IF NOT EXISTS entries_lease ON entries(lease_ns) WHERE lease_ns IS NOT NULL;
CREATE INDEX IF NOT EXISTS entries_retry ON entries(retry_ns) WHERE retry_ns IS NOT NULL;
DROP INDEX IF EXISTS entries_finished;
CREATE INDEX IF NOT EXISTS entries_purgeable ON entries(queue, state, finished_ns)
    WHERE finished_ns IS NOT NULL AND retry_ns IS NULL AND kind='message';
-- No index by queue and state (earlier versions made one): no query reads it (the status
-- scan reads every message, 15-30% quicker from the table), and every claim, finish and
-- publish wrote two of its pages to the log.
DROP INDEX IF EXISTS entries_queue_state;
-- The messages sharing a content, by queue and time in ready/: a publish's duplicate check
-- (the earliest in the window) reads one row however many copies the content has. Uploads
-- (no content yet) are not in it: an upload's create writes no page of it, and its publish
-- one (three while uploads were in it: one where it left them, two where it arrived).
DROP INDEX IF EXISTS entries_blob;
DROP INDEX IF EXISTS entries_blob_queue;
CREATE INDEX IF NOT EXISTS entries_sharing ON entries(blob, queue, enqueued_ns)
    WHERE blob IS NOT NULL;
-- A directory's entries in id order (the rowid follows the parent in the index): listings
-- and recovery read a directory a page at a time.
CREATE INDEX IF NOT EXISTS entries_parent ON entries(parent);
-- A directory's visible subdirectories (S_IFMT / S_IFDIR): its link count, asked by every stat
-- of working/, is counted here without reading the messages beside them.
CREATE INDEX IF NOT EXISTS entries_subdirs ON entries(parent)
    WHERE hidden=0 AND (mode & 61440)=16384;
-- Uploads still being written, and content no message holds: what recovery looks at.
CREATE INDEX IF NOT EXISTS entries_staged ON entries(id) WHERE staged=1;
CREATE INDEX IF NOT EXISTS blobs_unreferenced ON blobs(id) WHERE refcount=0;
"""

#: version -> statements that bring a store of that version to the next one
MIGRATIONS = {
    1: [
        "ALTER TABLE entries ADD COLUMN lease_ns INTEGER",
        "ALTER TABLE entries ADD COLUMN retry_ns INTEGER",
        "ALTER TABLE entries ADD COLUMN abandoned INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE entries ADD COLUMN duplicate_of INTEGER",
    ],
    2: [
        "ALTER TABLE entries ADD COLUMN atime_ns INTEGER",
    ],
}
