"""Pure measurement functions (the public Python API behind the analysis commands)."""
