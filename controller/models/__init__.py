"""Model directories the project builds itself (make-model): the real small instruct model and the tiny
test model.
"""
