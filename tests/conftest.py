# Shared fixtures live in plugin modules so each area can own its own file.
pytest_plugins = ["tests.model_fixtures", "tests.log_fixtures", "tests.memory_fixtures"]
