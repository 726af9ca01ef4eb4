"""One module per lesson: its panel of fake students for tests/test_pipeline.py."""
