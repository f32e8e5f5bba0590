"""The reward service (`tandem reward CONFIG`): reward models served by name over gRPC, each a sequence classifier
(classifier.py) or a generative judge on the native engine (judge.py), built by builder.py into RewardParts that
RewardService (service.py) takes; server.py is the protobuf edge."""
