"""SQLite store through sqlite-utils: schema, migrations, records, queries."""
