"""Systems under test: the Backend protocol, its optional capabilities, and one backend per engine."""
