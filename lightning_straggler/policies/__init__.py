"""Pure decision logic: numbers in, decisions out. No Horovod, no Lightning.

Every rank computes the same decision from the same inputs, so no rank has to tell the others.
"""
