
test-domain
	
fastx€Ð¬ó

slowabc

bannedb

whitelistedw