"""VeXact alignment contracts (not a package anyone imports: pytest collects it, scripts record its fixtures)."""
