"""JSON reports: the envelope and its schema, gates, comparisons, tables and plots."""
