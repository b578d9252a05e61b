"""What a run leaves behind (bench and twin alike): records, summaries, run directories, tables, reports."""
