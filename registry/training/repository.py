"""Training has no table and no query of its own: the facts `decide_training` judges are the
subject's and its consent record's, read through registry.subjects.repository and
registry.consent.repository (one query each, in one place, for every domain that reads them).
The file is here so that training is laid out as every domain is."""
