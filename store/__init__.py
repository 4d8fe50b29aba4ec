"""SQLite store through sqlite-utils: schema, migrations, records, queries.

Import from the submodules (`ddtree.store.db`, `.queries`, `.records`); the names below are the
ones other packages use most.
"""

from ddtree.store.db import data_dir, default_db_path, logs_dir, open_db, transaction
from ddtree.store.errors import StoreError

__all__ = ["StoreError", "data_dir", "default_db_path", "logs_dir", "open_db", "transaction"]
