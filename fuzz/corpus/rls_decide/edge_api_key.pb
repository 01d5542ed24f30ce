
edge#

generic_keyapi

api_keyk1