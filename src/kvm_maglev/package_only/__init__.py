"""What the package adds to its models beyond the code a Hub folder ships: saving the generated code files, carrying
the model card, saved caches and the row-block training loss.

The models' modules import these mixins, and `models.hub_code` leaves them out of the generated files (their
names are taken out of the class headers), so that a folder's code is the model alone: no network, no file writes.
"""
